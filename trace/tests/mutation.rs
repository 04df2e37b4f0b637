//! Randomly corrupted pickles (deterministic pseudo-random byte flips, insertions and
//! deletions of CPython's and our own output) never panic: every reader returns a value or a
//! typed error.

use gpualloc_trace::pickle::{self, Value};
use gpualloc_trace::{Action, Snapshot, TraceEntry};

/// xorshift64*: deterministic, dependency-free.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn small_snapshot() -> Vec<u8> {
    let mut e = TraceEntry::new(Action::Alloc, 1 << 40, 512, 0);
    e.frames = vec![gpualloc_trace::Frame::new("a.py", 1, "f")];
    let snap = Snapshot {
        device_traces: vec![vec![e.clone(), e]],
        allocator_settings: Some([("k".to_owned(), Value::Int(1))].into_iter().collect()),
        ..Snapshot::default()
    };
    snap.to_pickle().expect("exportable")
}

#[test]
fn corrupted_pickles_give_errors_not_panics() {
    let seeds: [&[u8]; 4] = [
        include_bytes!("data/small_p0.pickle"),
        include_bytes!("data/small_p4.pickle"),
        include_bytes!("data/extended_p5.pickle"),
        &small_snapshot(),
    ];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut outcomes = [0usize; 2];
    for round in 0..4_000 {
        let mut bytes = seeds[round % seeds.len()].to_vec();
        for _ in 0..1 + rng.below(3) {
            let at = rng.below(bytes.len());
            match rng.below(3) {
                0 => bytes[at] = rng.next() as u8,
                1 => bytes.insert(at, rng.next() as u8),
                _ => {
                    bytes.remove(at);
                }
            }
        }
        let read = pickle::read(&bytes);
        outcomes[usize::from(read.is_ok())] += 1;
        let _ = pickle::opcodes_used(&bytes);
        let _ = Snapshot::from_pickle(&bytes);
    }
    // Both outcomes happen: the corruption is neither always fatal nor always harmless.
    assert!(outcomes[0] > 100 && outcomes[1] > 100, "{outcomes:?}");
}
