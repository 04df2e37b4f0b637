//! Work on streams with the simulated GPU, as a user without a GPU would: a kernel (a closure
//! the sim runs on the stream's worker thread) writes a buffer, a second stream reads it after
//! waiting on an event, the buffer is marked as used there (`record_stream`), and the bytes
//! come back to the host through a pinned buffer.
//!
//! `cargo run --example streams`

use std::time::Duration;

use gpualloc::runtime::sim::{SimBackend, SimConfig};
use gpualloc::{Allocator, DeviceId, Error};

#[tokio::main]
async fn main() -> Result<(), Error> {
    let sim = SimBackend::new(SimConfig::default())?;
    let alloc = Allocator::builder().backend_instance(sim.clone()).build()?;
    let producer = alloc.new_stream(DeviceId(0))?;
    let consumer = alloc.new_stream(DeviceId(0))?;

    let buf = alloc.malloc(1 << 20, &producer).await?;
    let (ptr, len) = (buf.ptr(), buf.len());
    // A "kernel" on the producer stream: 5 ms of work that fills the buffer.
    sim.launch_kernel(producer.handle(), Duration::from_millis(5), move |mem| {
        mem.fill(ptr, len, 0x5a)
    })?;

    // Cross-stream use: the consumer waits for the producer's event, and the buffer is
    // recorded on the consumer, so dropping it cannot hand its memory out before the
    // consumer's work is done. Without the wait the consumer could read before the fill;
    // without record_stream the block could be reused while the consumer still reads it.
    let filled = producer.record_event()?;
    consumer.wait_event(&filled)?;
    buf.record_stream(&consumer)?;

    // Read it back on the consumer: the copy takes the pinned buffer and hands it back once
    // the stream has passed the copy.
    let host = alloc.host();
    let staging = host.malloc(len).await?;
    let staging = host.copy_d2h(&buf, staging, &consumer)?.finish().await?;
    drop(buf); // safe now or earlier: reuse waits for both streams
    let ok = staging.iter().all(|&b| b == 0x5a);
    println!("read {} bytes back, all 0x5a: {ok}", staging.len());
    drop(staging);
    alloc.shutdown().await?;
    if ok {
        Ok(())
    } else {
        Err(Error::Internal("the bytes read back differ".into()))
    }
}
