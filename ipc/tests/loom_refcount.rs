//! Loom model of the shared reference-count protocol ([`gpualloc_ipc::counter`] steps driven
//! by the exporter's [`ExportLedger`]): every interleaving of an importer accepting and
//! releasing, the exporter collecting, and the exporter reclaiming at EOF releases each export
//! exactly once, never before the importer's writes are visible, never lets a counter wrap,
//! and never lets an importer accept an offer the exporter already took back.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p gpualloc-ipc --release --test loom_refcount`.
#![cfg(loom)]

use gpualloc_ipc::counter::SharedCounter;
use gpualloc_ipc::ledger::ExportLedger;
use gpualloc_runtime::sync::atomic::{AtomicU64, Ordering};
use gpualloc_runtime::sync::Arc;
use loom::cell::UnsafeCell;
use loom::thread;

fn counters(n: usize) -> Arc<Vec<AtomicU64>> {
    Arc::new((0..n).map(|_| AtomicU64::new(0)).collect())
}

/// The block's contents: written by the importer, read by the exporter after reuse.
struct Block(UnsafeCell<u64>);
// SAFETY: loom checks every access for races; that is what the model verifies.
unsafe impl Sync for Block {}

#[test]
fn release_then_collect_sees_the_importers_writes_and_frees_once() {
    loom::model(|| {
        let c = counters(1);
        let block = Arc::new(Block(UnsafeCell::new(0)));
        let mut ledger = ExportLedger::new(1);
        let (id, slot) = ledger.offer(&c[..], "guard").unwrap();

        let (c2, b2) = (c.clone(), block.clone());
        let importer = thread::spawn(move || {
            assert!(c2[slot as usize].accept());
            b2.0.with_mut(|p| unsafe { *p = 42 });
            assert!(c2[slot as usize].release_one());
        });

        // The exporter polls, like a free-memory callback would.
        let mut freed = Vec::new();
        while freed.is_empty() {
            freed = ledger.collect(&c[..]);
            if freed.is_empty() {
                thread::yield_now();
            }
        }
        assert_eq!(freed, vec![(id, "guard")]);
        // Reuse: the importer's write happened-before, so this read does not race.
        block.0.with(|p| assert_eq!(unsafe { *p }, 42));
        importer.join().unwrap();
        assert!(ledger.collect(&c[..]).is_empty());
        assert_eq!(c[0].load(Ordering::SeqCst), 0);
    });
}

#[test]
fn release_racing_reclaim_at_eof_frees_exactly_once_and_never_wraps() {
    loom::model(|| {
        let c = counters(1);
        let mut ledger = ExportLedger::new(1);
        let (id, slot) = ledger.offer(&c[..], 7u32).unwrap();

        let c2 = c.clone();
        let importer = thread::spawn(move || {
            // An accept racing the take, then a late release and a repeated one.
            let accepted = c2[slot as usize].accept();
            let first = c2[slot as usize].release_one();
            let second = c2[slot as usize].release_one();
            assert!(!second);
            assert!(accepted || !first, "released a reference it never took");
            accepted
        });
        let reclaimed = ledger.reclaim_all(&c[..]);
        assert_eq!(reclaimed, vec![(id, 7)]);
        let _ = importer.join().unwrap();
        // Once taken back, the offer can no longer be accepted.
        assert!(!c[0].accept());
        assert_eq!(c[0].load(Ordering::SeqCst), 0);
        assert_eq!(ledger.outstanding(), 0);
        assert!(ledger.collect(&c[..]).is_empty());
    });
}

#[test]
fn two_importers_release_concurrently_each_export_freed_once() {
    loom::model(|| {
        let c = counters(2);
        let mut ledger = ExportLedger::new(2);
        let (a, sa) = ledger.offer(&c[..], 'a').unwrap();
        let (b, sb) = ledger.offer(&c[..], 'b').unwrap();
        let handles: Vec<_> = [sa, sb]
            .into_iter()
            .map(|slot| {
                let c = c.clone();
                thread::spawn(move || {
                    assert!(c[slot as usize].accept());
                    assert!(c[slot as usize].release_one());
                })
            })
            .collect();
        let mut freed = ledger.collect(&c[..]);
        for h in handles {
            h.join().unwrap();
        }
        freed.extend(ledger.collect(&c[..]));
        freed.sort();
        assert_eq!(freed, vec![(a, 'a'), (b, 'b')]);
        assert_eq!(ledger.outstanding(), 0);
    });
}
