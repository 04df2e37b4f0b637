//! The config's parser, builders and validation against PyTorch's rules.

use super::*;

#[test]
fn oom_snapshot_path_is_a_path_and_round_trips() {
    let c = AllocatorConfig::parse("expandable_segments:True, oom_snapshot_path:/tmp/o o.pickle")
        .unwrap();
    assert_eq!(c.oom_snapshot_path.as_deref(), Some("/tmp/o o.pickle"));
    assert_eq!(
        c.to_string(),
        "expandable_segments:True,oom_snapshot_path:/tmp/o o.pickle"
    );
    assert_eq!(AllocatorConfig::parse(&c.to_string()).unwrap(), c);
    assert_eq!(AllocatorConfig::default().oom_snapshot_path, None);
    match AllocatorConfig::parse("oom_snapshot_path:") {
        Err(ConfigError::InvalidValue { key, expected, .. }) => {
            assert_eq!(
                (key.as_str(), expected),
                ("oom_snapshot_path", "a file path")
            )
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn parses_pytorch_strings() {
    let c = AllocatorConfig::parse(
        "max_split_size_mb:512, max_non_split_rounding_mb:200,expandable_segments:True,\
         garbage_collection_threshold:0.6,per_process_memory_fraction:0.5,pinned_use_cuda_host_register:True",
    )
    .unwrap();
    assert_eq!(c.max_split_size, 512 << 20);
    assert_eq!(c.max_non_split_rounding, 200 << 20);
    assert!(c.expandable_segments);
    assert_eq!(c.garbage_collection_threshold, 0.6);
    assert_eq!(c.per_process_memory_fraction, Some(0.5));
    assert_eq!(
        c.pinned,
        vec![("pinned_use_cuda_host_register".into(), "True".into())]
    );
    assert_eq!(
        AllocatorConfig::parse("").unwrap(),
        AllocatorConfig::default()
    );
}

#[test]
fn division_lists_follow_pytorch() {
    let c = AllocatorConfig::parse("roundup_power2_divisions:[64:8,256:4,1024:4,>:1]").unwrap();
    assert_eq!(&c.roundup_power2_divisions[..7], &[8, 8, 8, 8, 8, 8, 8]);
    assert_eq!(c.roundup_power2_divisions[7], 0);
    assert_eq!(c.roundup_power2_divisions[8], 4);
    assert_eq!(c.roundup_power2_divisions[9], 0);
    assert_eq!(&c.roundup_power2_divisions[10..], &[1; 6]);
}

#[test]
fn bad_strings_name_the_key() {
    let err = |s: &str| AllocatorConfig::parse(s).unwrap_err();
    assert_eq!(
        err("max_split_size:512"),
        ConfigError::UnknownKey("max_split_size".into())
    );
    assert!(
        matches!(err("max_split_size_mb:abc"), ConfigError::InvalidValue { key, .. } if key == "max_split_size_mb")
    );
    assert!(matches!(
        err("max_split_size_mb:20"),
        ConfigError::InvalidValue { .. }
    ));
    assert!(matches!(
        err("max_split_size_mb:99999999999999999"),
        ConfigError::InvalidValue { .. }
    ));
    assert!(matches!(
        err("roundup_power2_divisions:3"),
        ConfigError::InvalidValue { .. }
    ));
    assert!(matches!(
        err("roundup_power2_divisions:[64:8,100:4]"),
        ConfigError::InvalidValue { .. }
    ));
    assert!(matches!(
        err("roundup_power2_divisions:[64:8"),
        ConfigError::Syntax(_)
    ));
    assert!(matches!(
        err("garbage_collection_threshold:1.5"),
        ConfigError::InvalidValue { .. }
    ));
    assert!(matches!(
        err("expandable_segments:yes"),
        ConfigError::InvalidValue { .. }
    ));
    assert!(matches!(
        err("backend:cudaMallocAsync"),
        ConfigError::InvalidValue { .. }
    ));
    assert!(matches!(err("expandable_segments"), ConfigError::Syntax(_)));
    assert!(matches!(
        err("large_segment_size_mb:3"),
        ConfigError::InvalidValue { .. }
    ));
    assert!(matches!(
        err("thread_cache:maybe"),
        ConfigError::InvalidValue { .. }
    ));
}

#[test]
fn thread_cache_key() {
    assert!(AllocatorConfig::default().thread_cache);
    let off = AllocatorConfig::parse("thread_cache:False").unwrap();
    assert!(!off.thread_cache);
    assert_eq!(off, AllocatorConfig::default().with_thread_cache(false));
    assert_eq!(off.to_string(), "thread_cache:False");
    assert_eq!(AllocatorConfig::parse(&off.to_string()).unwrap(), off);
}

#[test]
fn expandable_segments_by_default_under_the_gpualloc_policy() {
    let plain = AllocatorConfig::parse("").unwrap();
    assert!(!plain.expandable_segments, "the core runs what it is given");
    assert!(plain.resolved(true).expandable_segments);
    assert!(
        !plain.resolved(false).expandable_segments,
        "no virtual memory"
    );
    // The choice is named, so it reads back the same on any backend.
    assert_eq!(
        plain.resolved(false).to_string(),
        "expandable_segments:False"
    );
    let back = AllocatorConfig::parse(&plain.resolved(false).to_string()).unwrap();
    assert!(!back.resolved(true).expandable_segments);
    let off = AllocatorConfig::parse("expandable_segments:False").unwrap();
    assert!(off.expandable_segments_named);
    assert!(!off.resolved(true).expandable_segments, "named: kept");
    assert_eq!(off.to_string(), "expandable_segments:False");
    assert_eq!(AllocatorConfig::parse(&off.to_string()).unwrap(), off);
    assert!(
        !AllocatorConfig::default()
            .with_expandable_segments(false)
            .resolved(true)
            .expandable_segments
    );
    let on = AllocatorConfig::parse("expandable_segments:True").unwrap();
    assert_eq!(
        on.resolved(false),
        on,
        "asked for: kept, as the backend will refuse"
    );
    let torch = AllocatorConfig::parse("policy:pytorch").unwrap();
    assert!(
        !torch.resolved(true).expandable_segments,
        "PyTorch's default"
    );
    assert_eq!(plain.resolved(true).to_string(), "expandable_segments:True");
}

#[test]
fn policy_key() {
    assert_eq!(AllocatorConfig::default().policy, Policy::Gpualloc);
    let torch = AllocatorConfig::parse("policy:pytorch").unwrap();
    assert_eq!(torch.policy, Policy::Pytorch);
    assert_eq!(
        torch,
        AllocatorConfig::default().with_policy(Policy::Pytorch)
    );
    assert_eq!(torch.to_string(), "policy:pytorch");
    assert_eq!(AllocatorConfig::parse(&torch.to_string()).unwrap(), torch);
    // The default policy is not written back, like every default.
    assert_eq!(
        AllocatorConfig::parse("policy:gpualloc")
            .unwrap()
            .to_string(),
        ""
    );
    match AllocatorConfig::parse("policy:tensorflow") {
        Err(ConfigError::InvalidValue { key, expected, .. }) => {
            assert_eq!(key, "policy");
            assert_eq!(expected, "pytorch or gpualloc");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn debug_cross_stream_frees_key() {
    assert!(!AllocatorConfig::default().debug_cross_stream_frees);
    let on = AllocatorConfig::parse("debug_cross_stream_frees:True").unwrap();
    assert!(on.debug_cross_stream_frees);
    assert_eq!(
        on,
        AllocatorConfig::default().with_debug_cross_stream_frees(true)
    );
    assert_eq!(on.to_string(), "debug_cross_stream_frees:True");
    assert_eq!(AllocatorConfig::parse(&on.to_string()).unwrap(), on);
    assert!(matches!(
        AllocatorConfig::parse("debug_cross_stream_frees:yes"),
        Err(ConfigError::InvalidValue { .. })
    ));
}

#[test]
fn display_round_trips() {
    let c = AllocatorConfig::parse(
        "max_split_size_mb:512,expandable_segments:True,roundup_power2_divisions:[64:8,>:2]",
    )
    .unwrap();
    assert_eq!(AllocatorConfig::parse(&c.to_string()).unwrap(), c);
}

#[test]
fn validate_holds_typed_fields_to_the_parsers_rules() {
    let ok = |c: AllocatorConfig| c.validate().is_ok();
    let d = AllocatorConfig::default;
    assert!(ok(d()));
    let parsed = AllocatorConfig::parse(
        "max_split_size_mb:21,large_segment_size_mb:4,garbage_collection_threshold:0.5,\
         per_process_memory_fraction:1.0,roundup_power2_divisions:[64:8,>:1],pinned_num_register_threads:2",
    )
    .unwrap();
    assert!(ok(parsed), "whatever the parser accepts validates");
    // max_split_size: unlimited, or above 20 MiB.
    assert!(!ok(AllocatorConfig {
        max_split_size: 20 * MIB,
        ..d()
    }));
    assert!(ok(AllocatorConfig {
        max_split_size: 20 * MIB + 1,
        ..d()
    }));
    assert!(!ok(AllocatorConfig {
        max_split_size: 0,
        ..d()
    }));
    // Divisions: 0 or powers of two.
    let mut div = [0; ROUNDUP_BANDS];
    div[3] = 4;
    div[5] = 1;
    assert!(ok(AllocatorConfig {
        roundup_power2_divisions: div,
        ..d()
    }));
    div[4] = 3;
    assert!(!ok(AllocatorConfig {
        roundup_power2_divisions: div,
        ..d()
    }));
    // Garbage collection: 0 (off) or in (0, 1).
    for (t, good) in [
        (0.0, true),
        (1e-9, true),
        (0.5, true),
        (0.999, true),
        (1.0, false),
        (-0.1, false),
        (f64::NAN, false),
    ] {
        assert_eq!(
            ok(AllocatorConfig {
                garbage_collection_threshold: t,
                ..d()
            }),
            good,
            "{t}"
        );
    }
    // Large segments: an even number of MiB, at least 2.
    for (size, good) in [
        (2 * MIB, true),
        (4 * MIB, true),
        (MIB, false),
        (3 * MIB, false),
        (2 * MIB + 1, false),
        (0, false),
    ] {
        assert_eq!(
            ok(AllocatorConfig {
                large_segment_size: size,
                ..d()
            }),
            good,
            "{size}"
        );
    }
    // Fraction: in (0, 1].
    for (f, good) in [
        (1.0, true),
        (1e-9, true),
        (0.0, false),
        (1.0001, false),
        (-1.0, false),
        (f64::NAN, false),
    ] {
        assert_eq!(
            ok(AllocatorConfig {
                per_process_memory_fraction: Some(f),
                ..d()
            }),
            good,
            "{f}"
        );
    }
    let foreign = AllocatorConfig {
        pinned: vec![("other".into(), "1".into())],
        ..d()
    };
    assert_eq!(
        foreign.validate(),
        Err(ConfigError::UnknownKey("other".into()))
    );
    let err = AllocatorConfig {
        large_segment_size: 3,
        ..d()
    }
    .validate()
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid value `3 bytes` for `large_segment_size_mb`: expected an even number of MiB, at least 2"
    );
}
