//! Hits while misses are slow: a 10 ms device malloc, slow growth or garbage collection, and
//! one device of eight flooded (sections `miss`, `slowcalls`, `flood`).

use super::*;

/// Hit pairs on `stream` for `dur`; per-pair latencies in ns.
async fn hits_for(alloc: &Allocator, stream: &Stream, dur: Duration) -> Vec<u64> {
    hits_kept(alloc, stream, dur, || true).await
}

/// Hit pairs on `stream` for `dur`, keeping only those that started while a sim call was
/// paying its latency (the slow call of another task's miss): a hit stuck behind that call is
/// one sample among the few that overlap it, not one among a million. In ns.
async fn hits_during_slow_calls(alloc: &Allocator, stream: &Stream, dur: Duration) -> Vec<u64> {
    hits_kept(alloc, stream, dur, || {
        gpualloc::runtime::sim::sleeping_now() > 0
    })
    .await
}

/// Hit pairs on `stream` for `dur`; the latencies (ns) of those for which `keep()` held when
/// they started.
async fn hits_kept(
    alloc: &Allocator,
    stream: &Stream,
    dur: Duration,
    keep: impl Fn() -> bool,
) -> Vec<u64> {
    let mut samples = Vec::with_capacity(1 << 20);
    let end = Instant::now() + dur;
    let mut i = 0u64;
    loop {
        let kept = keep();
        let t = Instant::now();
        let b = alloc.malloc(HIT_SIZE, stream).await.expect("malloc");
        drop(b);
        if kept {
            samples.push(t.elapsed().as_nanos() as u64);
        }
        i += 1;
        if i % 256 == 0 {
            if Instant::now() >= end {
                break;
            }
            // Let other tasks on this worker run, as a service's tasks would.
            tokio::task::yield_now().await;
        }
    }
    samples
}

pub(crate) async fn slow_miss(figures: &mut Vec<Figure>, path: Path) {
    let alloc = build(
        if on_cuda() {
            cuda()
        } else {
            slow_malloc_sim(1)
        },
        path,
    );
    let stream = alloc.new_stream(DeviceId(0)).expect("stream");
    drop(alloc.malloc(HIT_SIZE, &stream).await.expect("warm"));
    let mut quiet = hits_for(&alloc, &stream, Duration::from_millis(200)).await;
    let miss_alloc = alloc.clone();
    let miss_stream = alloc.new_stream(DeviceId(0)).expect("stream");
    let misser = tokio::spawn(async move {
        let mut kept = Vec::new();
        let end = Instant::now() + Duration::from_millis(400);
        let mut i = 0;
        while Instant::now() < end {
            // A full device (a real GPU is quick to fill) ends the misses.
            match miss_alloc
                .malloc(64 * MIB + i * 2 * MIB, &miss_stream)
                .await
            {
                Ok(b) => kept.push(b),
                Err(_) => break,
            }
            i += 1;
        }
        kept.len()
    });
    tokio::time::sleep(Duration::from_millis(5)).await;
    let mut busy = hits_for(&alloc, &stream, Duration::from_millis(300)).await;
    let misses = misser.await.unwrap_or(0);
    if misses == 0 {
        eprintln!("bench: the miss task made no progress");
    }
    figures.push(Figure {
        name: path.name(
            "hit_p99_during_slow_miss_us",
            "hit_p99_during_slow_miss_gate_us",
        ),
        value: percentile(&mut busy, 0.99) / 1000.0,
        unit: "us",
        reference: percentile(&mut quiet, 0.99) / 1000.0,
    });
    let _ = alloc.shutdown().await;
}

/// The slow backend work a miss can do besides a device malloc (section `slowcalls`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum SlowWork {
    /// Growing an expandable segment: one 20 MiB page per miss, its map costing 10 ms.
    ExpandableGrowth,
    /// A garbage-collection pass: cached segments freed at 10 ms each before the malloc.
    GarbageCollection,
}

/// p99 of the hits that start while another task's miss is in a slow call of `work` (sim,
/// 10 ms per call), vs the p99 of hits without misses (target: <= 2x).
pub(crate) async fn slow_work(figures: &mut Vec<Figure>, path: Path, work: SlowWork) {
    let (conf, latency) = match work {
        SlowWork::ExpandableGrowth => (
            "expandable_segments:True",
            LatencyModel {
                map: Duration::from_millis(10),
                ..LatencyModel::zero()
            },
        ),
        SlowWork::GarbageCollection => (
            // Garbage collection frees whole ordinary segments (expandable ones, the default
            // under the gpualloc policy, give pages back through `empty_cache` only).
            "garbage_collection_threshold:0.5,per_process_memory_fraction:1.0,expandable_segments:False",
            LatencyModel {
                free: Duration::from_millis(10),
                ..LatencyModel::zero()
            },
        ),
    };
    let sim = match SimBackend::new(SimConfig {
        capacity_per_device: 1 << 30,
        latency,
        ..SimConfig::fast(1)
    }) {
        Ok(sim) => sim,
        Err(e) => {
            eprintln!("bench: cannot build the sim: {e}");
            std::process::exit(2);
        }
    };
    let mut config = AllocatorConfig::parse(conf).expect("config");
    config.thread_cache = path == Path::ThreadCache;
    let alloc = match Allocator::builder()
        .config(config)
        .backend_instance(sim.clone())
        .build()
    {
        Ok(a) => a,
        Err(e) => {
            eprintln!("bench: cannot build the allocator: {e}");
            std::process::exit(2);
        }
    };
    let stream = alloc.new_stream(DeviceId(0)).expect("stream");
    drop(alloc.malloc(HIT_SIZE, &stream).await.expect("warm"));
    let mut quiet = hits_for(&alloc, &stream, Duration::from_millis(200)).await;
    let (miss_alloc, miss_stream) = (
        alloc.clone(),
        alloc.new_stream(DeviceId(0)).expect("stream"),
    );
    let slow_calls = move || {
        let c = sim.counts();
        c.get(gpualloc::runtime::sim::Op::Map) + c.get(gpualloc::runtime::sim::Op::Free)
    };
    let before = slow_calls();
    let misser = tokio::spawn(async move {
        let mut kept = Vec::new();
        let end = Instant::now() + Duration::from_millis(400);
        let mut i = 0;
        while Instant::now() < end {
            let size = match work {
                // Each request needs one more page.
                SlowWork::ExpandableGrowth => 20 * MIB,
                // Sizes never repeat: each is a miss, freed at once into the cache, which
                // stays above the 512 MiB threshold, so every miss runs a pass.
                SlowWork::GarbageCollection => 64 * MIB + (i % 64) * 2 * MIB,
            };
            match miss_alloc.malloc(size, &miss_stream).await {
                Ok(b) if work == SlowWork::ExpandableGrowth => kept.push(b),
                Ok(b) => drop(b),
                Err(_) => break,
            }
            i += 1;
        }
        i
    });
    tokio::time::sleep(Duration::from_millis(5)).await;
    let mut busy = hits_during_slow_calls(&alloc, &stream, Duration::from_millis(300)).await;
    let misses = misser.await.unwrap_or(0);
    eprintln!(
        "bench: {} misses, {} slow calls (maps + frees); {} hits started during them, slowest {} us",
        misses,
        slow_calls() - before,
        busy.len(),
        busy.iter().max().copied().unwrap_or(0) / 1000
    );
    let name = match work {
        SlowWork::ExpandableGrowth => path.name(
            "hit_p99_during_expandable_growth_us",
            "hit_p99_during_expandable_growth_gate_us",
        ),
        SlowWork::GarbageCollection => path.name(
            "hit_p99_during_gc_pass_us",
            "hit_p99_during_gc_pass_gate_us",
        ),
    };
    figures.push(Figure {
        name,
        value: percentile(&mut busy, 0.99) / 1000.0,
        unit: "us",
        reference: percentile(&mut quiet, 0.99) / 1000.0,
    });
    let _ = alloc.shutdown().await;
}

pub(crate) async fn flooded_device(figures: &mut Vec<Figure>, path: Path) {
    let alloc = build(
        if on_cuda() {
            cuda()
        } else {
            slow_malloc_sim(8)
        },
        path,
    );
    if alloc.device_count() < 2 {
        eprintln!(
            "bench: flood skipped: it needs 2+ devices, this backend has {}",
            alloc.device_count()
        );
        let _ = alloc.shutdown().await;
        return;
    }
    async fn others(alloc: &Allocator) -> Vec<u64> {
        let handles: Vec<_> = (1..alloc.device_count())
            .map(|d| {
                let alloc = alloc.clone();
                tokio::spawn(async move {
                    let s = alloc.new_stream(DeviceId(d)).expect("stream");
                    drop(alloc.malloc(HIT_SIZE, &s).await.expect("warm"));
                    hits_for(&alloc, &s, Duration::from_millis(200)).await
                })
            })
            .collect();
        let mut all = Vec::new();
        for h in handles {
            all.extend(h.await.unwrap_or_default());
        }
        all
    }
    let mut quiet = others(&alloc).await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood: Vec<_> = (0..16u64)
        .map(|_| {
            let alloc = alloc.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let s = alloc.new_stream(DeviceId(0)).expect("stream");
                let mut kept = Vec::new();
                let mut i = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    // Misses (10 ms device mallocs; each task on its own stream, so freed
                    // blocks do not serve the others) interleaved with hits. Device-full
                    // errors are part of a flood: ignored.
                    if let Ok(b) = alloc.malloc(32 * MIB + (i % 16) * 2 * MIB, &s).await {
                        kept.push(b);
                    }
                    if kept.len() >= 8 {
                        kept.clear();
                    }
                    for _ in 0..64 {
                        if let Ok(b) = alloc.malloc(HIT_SIZE, &s).await {
                            drop(b);
                        }
                    }
                    i += 1;
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut busy = others(&alloc).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for h in flood {
        let _ = h.await;
    }
    match alloc.stats(DeviceId(0)).await {
        Ok(st) if st.num_device_alloc > 0 => {}
        _ => eprintln!("bench: the flooded device made no device mallocs"),
    }
    figures.push(Figure {
        name: path.name(
            "others_p99_one_device_flooded_us",
            "others_p99_one_device_flooded_gate_us",
        ),
        value: percentile(&mut busy, 0.99) / 1000.0,
        unit: "us",
        reference: percentile(&mut quiet, 0.99) / 1000.0,
    });
    let _ = alloc.shutdown().await;
}
