//! [`CoherenceGuard`] on the sim: a simulated kernel reads what the CPU wrote after
//! `before_device_read`, and the CPU reads what a kernel wrote after `after_device_write`,
//! round after round on the same registered buffer.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpualloc_host::mapping::{page_size, PageMapping};
use gpualloc_host_register::{CoherenceGuard, HostRegistry};
use gpualloc_runtime::{Backend, DeviceId, DevicePtr, HostRegisterFlags, Stream};
use gpualloc_sim::{SimBackend, SimConfig};

const RW: HostRegisterFlags = HostRegisterFlags {
    portable: false,
    device_map: false,
    read_only: false,
};

#[test]
fn kernels_see_cpu_writes_and_the_cpu_sees_kernel_writes() {
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let backend: Arc<dyn Backend> = sim.clone();
    let stream = Stream::new(&backend, DeviceId(0)).unwrap();
    let p = page_size();
    let mut mem = PageMapping::new(2 * p).unwrap();
    let addr = mem.addr();
    let mut reg = HostRegistry::new(backend);
    // SAFETY: this test's own mapped memory, which outlives the registration; no copy is queued on
    // it.
    let id = unsafe { reg.register(mem.as_ptr(), 2 * p as u64, RW) }.unwrap();
    let guard = CoherenceGuard::new(reg.info(id).unwrap().user_range);
    assert_eq!(guard.range(), addr..addr + 2 * p as u64);

    let seen = Arc::new(Mutex::new(Vec::new()));
    for round in 0..50u64 {
        // CPU writes the input half
        let input: Vec<u8> = (0..p).map(|i| (i as u64 * 31 + round) as u8).collect();
        mem.as_mut_slice()[..p].copy_from_slice(&input);
        guard.before_device_read(&stream).unwrap();
        // the "kernel" sums the input and writes its bytes + 1 into the output half
        let seen_k = seen.clone();
        sim.launch_kernel(stream.handle(), Duration::from_micros(50), move |km| {
            let data = km.read(DevicePtr(addr), p as u64)?;
            let sum: u64 = data.iter().map(|b| u64::from(*b)).sum();
            seen_k.lock().unwrap().push(sum);
            let out: Vec<u8> = data.iter().map(|b| b.wrapping_add(1)).collect();
            km.write(DevicePtr(addr + p as u64), &out)
        })
        .unwrap();
        guard.after_device_write(&stream).unwrap();
        let expected_sum: u64 = input.iter().map(|b| u64::from(*b)).sum();
        assert_eq!(
            seen.lock().unwrap().last(),
            Some(&expected_sum),
            "round {round}"
        );
        let out = &mem.as_slice()[p..];
        assert!(
            out.iter().zip(&input).all(|(o, i)| *o == i.wrapping_add(1)),
            "round {round}: CPU read stale kernel output"
        );
    }
    assert_eq!(seen.lock().unwrap().len(), 50);
    assert_eq!(sim.kernel_failures(), 0);

    // the async variant
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    mem.as_mut_slice()[..p].fill(7);
    guard.before_device_read(&stream).unwrap();
    sim.launch_kernel(stream.handle(), Duration::from_millis(5), move |km| {
        let data = km.read(DevicePtr(addr), p as u64)?;
        km.write(DevicePtr(addr + p as u64), &data)
    })
    .unwrap();
    rt.block_on(guard.after_device_write_async(&stream))
        .unwrap();
    assert!(mem.as_slice()[p..].iter().all(|b| *b == 7));

    // without the registration the device cannot touch the buffer at all
    reg.release(id).unwrap();
    sim.launch_kernel(stream.handle(), Duration::ZERO, move |km| {
        km.read(DevicePtr(addr), 1).map(|_| ())
    })
    .unwrap();
    assert!(guard.after_device_write(&stream).is_err() || stream.synchronize().is_err());
    assert_eq!(sim.kernel_failures(), 1);
}
