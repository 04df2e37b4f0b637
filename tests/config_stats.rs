//! The typed config is held to the string parser's rules at `build()`, and the statistics API
//! a PyTorch user expects: resets through the actor, named pool accessors, the flat map with
//! PyTorch's 122 keys.

use gpualloc::runtime::accounting::AccountingBackend;
use gpualloc::{Allocator, AllocatorConfig, ConfigError, DeviceId, Error, StatType};
use std::sync::Arc;

const MIB: u64 = 1 << 20;

fn build(config: AllocatorConfig) -> Result<Allocator, Error> {
    Allocator::builder()
        .config(config)
        .backend_instance(Arc::new(AccountingBackend::new(1, 64 * MIB)))
        .build()
}

fn rejected_key(config: AllocatorConfig) -> String {
    match build(config) {
        Err(Error::Config(ConfigError::InvalidValue { key, .. })) => key,
        Err(other) => panic!("expected a typed config error, got {other}"),
        Ok(_) => panic!("an invalid config was accepted"),
    }
}

#[tokio::test]
async fn invalid_public_fields_are_refused_at_build() {
    let d = AllocatorConfig::default;
    let cases: Vec<(AllocatorConfig, &str)> = vec![
        (
            AllocatorConfig {
                per_process_memory_fraction: Some(1.5),
                ..d()
            },
            "per_process_memory_fraction",
        ),
        (
            AllocatorConfig {
                per_process_memory_fraction: Some(-1.0),
                ..d()
            },
            "per_process_memory_fraction",
        ),
        (
            AllocatorConfig {
                per_process_memory_fraction: Some(f64::NAN),
                ..d()
            },
            "per_process_memory_fraction",
        ),
        (
            AllocatorConfig {
                garbage_collection_threshold: 1.5,
                ..d()
            },
            "garbage_collection_threshold",
        ),
        (
            AllocatorConfig {
                garbage_collection_threshold: -0.1,
                ..d()
            },
            "garbage_collection_threshold",
        ),
        (
            AllocatorConfig {
                max_split_size: 0,
                ..d()
            },
            "max_split_size_mb",
        ),
        (
            AllocatorConfig {
                max_split_size: 20 * MIB,
                ..d()
            },
            "max_split_size_mb",
        ),
        (
            AllocatorConfig {
                large_segment_size: 3,
                ..d()
            },
            "large_segment_size_mb",
        ),
        (
            AllocatorConfig {
                large_segment_size: 3 * MIB,
                ..d()
            },
            "large_segment_size_mb",
        ),
        (
            AllocatorConfig {
                roundup_power2_divisions: [3; gpualloc::devices::sizes::ROUNDUP_BANDS],
                ..d()
            },
            "roundup_power2_divisions",
        ),
    ];
    for (config, key) in cases {
        let shown = format!("{config:?}");
        assert_eq!(rejected_key(config), key, "{shown}");
    }
    // The error text names the key, the value and what it takes.
    let err = build(AllocatorConfig {
        per_process_memory_fraction: Some(1.5),
        ..d()
    })
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid value `1.5` for `per_process_memory_fraction`: expected a number in (0.0, 1.0]"
    );
    // Valid typed values still build.
    let ok = AllocatorConfig {
        max_split_size: 21 * MIB,
        large_segment_size: 4 * MIB,
        per_process_memory_fraction: Some(1.0),
        garbage_collection_threshold: 0.5,
        ..d()
    };
    build(ok).expect("valid config").shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resets_go_through_the_actor_in_every_config() {
    for conf in ["", "thread_cache:False", "expandable_segments:True"] {
        let alloc = Allocator::builder()
            .config_str(conf)
            .backend_instance(Arc::new(AccountingBackend::new(1, 1 << 30)))
            .build()
            .unwrap();
        let s = alloc.new_stream(DeviceId(0)).unwrap();
        let a = alloc.malloc(8 * MIB, &s).await.unwrap();
        let b = alloc.malloc(MIB / 2, &s).await.unwrap();
        drop(a);
        let st = alloc.stats(DeviceId(0)).await.unwrap();
        assert_eq!(st.allocated_bytes.all().peak, 8 * MIB + MIB / 2, "{conf:?}");
        assert_eq!(st.allocated_bytes.large().peak, 8 * MIB, "{conf:?}");
        assert_eq!(st.allocated_bytes.small().current, MIB / 2, "{conf:?}");
        assert_eq!(st.allocation[StatType::All].allocated, 2, "{conf:?}");

        alloc.reset_peak_stats(DeviceId(0)).await.unwrap();
        let st = alloc.stats(DeviceId(0)).await.unwrap();
        assert_eq!(
            st.allocated_bytes.all().peak,
            MIB / 2,
            "{conf:?}: peak is now current"
        );
        assert_eq!(st.allocated_bytes.large().peak, 0, "{conf:?}");
        assert_eq!(
            st.allocation.all().allocated,
            2,
            "{conf:?}: sums untouched by a peak reset"
        );

        alloc.reset_accumulated_stats(DeviceId(0)).await.unwrap();
        let st = alloc.stats(DeviceId(0)).await.unwrap();
        assert_eq!(st.allocation.all().allocated, 0, "{conf:?}");
        assert_eq!(st.allocation.all().freed, 0, "{conf:?}");
        assert_eq!(st.num_device_alloc, 0, "{conf:?}");
        assert_eq!(
            st.allocation.all().current,
            1,
            "{conf:?}: currents untouched"
        );

        let flat = st.to_flat();
        assert_eq!(flat.len(), 122);
        assert_eq!(
            flat["max_split_size"], -1,
            "{conf:?}: unlimited reads as PyTorch's -1"
        );
        assert_eq!(flat["allocated_bytes.small_pool.current"], (MIB / 2) as i64);
        drop(b);
        assert!(matches!(
            alloc.reset_peak_stats(DeviceId(3)).await,
            Err(Error::InvalidDevice { device: 3, .. })
        ));
        alloc.shutdown().await.unwrap();
    }
    let alloc = Allocator::builder()
        .config_str("max_split_size_mb:128")
        .backend_instance(Arc::new(AccountingBackend::new(1, 1 << 30)))
        .build()
        .unwrap();
    let flat = alloc.stats(DeviceId(0)).await.unwrap().to_flat();
    assert_eq!(flat["max_split_size"], 128 << 20);
    alloc.shutdown().await.unwrap();
}

#[tokio::test]
async fn an_oom_error_carries_its_report() {
    let alloc = build(AllocatorConfig::default()).unwrap();
    let s = alloc.new_stream(DeviceId(0)).unwrap();
    let err = alloc.malloc(100 * MIB, &s).await.unwrap_err();
    assert!(err.is_oom());
    let report = err.oom_report().expect("a report");
    assert_eq!(report.requested, 100 * MIB);
    assert_eq!(report.device_total, 64 * MIB);
    assert_eq!(gpualloc::format_size(report.requested), "100.00 MiB");
    alloc.shutdown().await.unwrap();
}
