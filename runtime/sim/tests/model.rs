//! Property test: random stream-ordered writes, memsets and copies across device
//! allocations, pinned memory and a VMM mapping behave exactly like a byte-array model.
#![cfg(not(loom))] // the sim runs real threads; loom builds run only the loom models

use gpualloc_runtime::{Backend, DeviceId, DevicePtr};
use gpualloc_sim::{SimBackend, SimConfig};
use proptest::prelude::*;

const D0: DeviceId = DeviceId(0);
const LEN: u64 = 64 << 10;

#[derive(Debug, Clone)]
enum Step {
    Write {
        buf: usize,
        off: u64,
        bytes: Vec<u8>,
    },
    Memset {
        buf: usize,
        off: u64,
        len: u64,
        value: u8,
    },
    Copy {
        dst: usize,
        dst_off: u64,
        src: usize,
        src_off: u64,
        len: u64,
    },
    Read {
        buf: usize,
        off: u64,
        len: u64,
    },
}

fn step() -> impl Strategy<Value = Step> {
    let buf = 0..3usize;
    let off = 0..LEN;
    prop_oneof![
        (
            buf.clone(),
            off.clone(),
            prop::collection::vec(any::<u8>(), 1..512)
        )
            .prop_map(|(buf, off, bytes)| Step::Write { buf, off, bytes }),
        (buf.clone(), off.clone(), 1..4096u64, any::<u8>()).prop_map(|(buf, off, len, value)| {
            Step::Memset {
                buf,
                off,
                len,
                value,
            }
        }),
        (
            buf.clone(),
            off.clone(),
            buf.clone(),
            off.clone(),
            1..4096u64
        )
            .prop_map(|(dst, dst_off, src, src_off, len)| Step::Copy {
                dst,
                dst_off,
                src,
                src_off,
                len
            }),
        (buf, off, 1..4096u64).prop_map(|(buf, off, len)| Step::Read { buf, off, len }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn sim_memory_matches_a_byte_model(steps in prop::collection::vec(step(), 1..40)) {
        let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
        let s = sim.stream_create(D0).unwrap();
        let g = sim.vmm_granularity(D0).unwrap();
        // Three buffers: a device allocation, pinned host memory, a VMM mapping.
        let dev = sim.malloc(D0, LEN).unwrap();
        let pinned = sim.host_alloc(LEN).unwrap() as u64;
        let va = sim.va_reserve(D0, g, 0).unwrap();
        let h = sim.phys_create(D0, g).unwrap();
        sim.map(va, g, 0, h).unwrap();
        sim.set_access(D0, va, g).unwrap();
        let bases = [dev.0, pinned, va.0];
        // The mapping is a whole granule: its model is that long.
        let caps = [LEN, LEN, g];
        let mut model: Vec<Vec<u8>> = caps.iter().map(|c| vec![0u8; *c as usize]).collect();
        for (b, cap) in bases.iter().zip(caps) {
            sim.memset_async(s, DevicePtr(*b), 0, cap).unwrap();
        }
        for st in steps {
            match st {
                Step::Write { buf, off, bytes } => {
                    let r = sim.copy_to_device(s, DevicePtr(bases[buf] + off), &bytes);
                    if off + bytes.len() as u64 <= caps[buf] {
                        r.unwrap();
                        model[buf][off as usize..off as usize + bytes.len()].copy_from_slice(&bytes);
                    } else {
                        prop_assert!(r.is_err(), "write past the end accepted");
                    }
                }
                Step::Memset { buf, off, len, value } => {
                    let r = sim.memset_async(s, DevicePtr(bases[buf] + off), value, len);
                    if off + len <= caps[buf] {
                        r.unwrap();
                        model[buf][off as usize..(off + len) as usize].fill(value);
                    } else {
                        prop_assert!(r.is_err(), "memset past the end accepted");
                    }
                }
                Step::Copy { dst, dst_off, src, src_off, len } => {
                    let r = sim.memcpy_async(s, bases[dst] + dst_off, bases[src] + src_off, len);
                    if dst_off + len <= caps[dst] && src_off + len <= caps[src] {
                        r.unwrap();
                        let tmp = model[src][src_off as usize..(src_off + len) as usize].to_vec();
                        model[dst][dst_off as usize..(dst_off + len) as usize].copy_from_slice(&tmp);
                    } else {
                        prop_assert!(r.is_err(), "copy past the end accepted");
                    }
                }
                Step::Read { buf, off, len } => {
                    if off + len <= caps[buf] {
                        let mut out = vec![0u8; len as usize];
                        sim.copy_from_device(s, &mut out, DevicePtr(bases[buf] + off)).unwrap();
                        prop_assert_eq!(&out[..], &model[buf][off as usize..(off + len) as usize]);
                    }
                }
            }
        }
        for (i, b) in bases.iter().enumerate() {
            let mut out = vec![0u8; caps[i] as usize];
            sim.copy_from_device(s, &mut out, DevicePtr(*b)).unwrap();
            prop_assert!(out == model[i], "buffer {} differs from the model", i);
        }
        sim.stream_synchronize(s).unwrap();
        prop_assert_eq!(sim.kernel_failures(), 0);
    }
}
