//! The legacy default (null) stream orders itself with blocking streams, as the driver
//! documents: work on it waits for the blocking streams' earlier work, and their later work
//! waits for it; non-blocking streams (every stream the CUDA backend creates) stay unordered.
//! A binary of its own: the null stream is one per device and process, shared by every test.

use std::time::{Duration, Instant};

mod common;

use common::{bind, event, hold, stream_with as stream};
use gpualloc_cuda_emu::*;

/// An event recorded on `s` now: whether it completes within 2 s.
fn completes(s: CUstream) -> bool {
    let e = event();
    assert_eq!(cuEventRecord(e, s), CUDA_SUCCESS);
    let t = Instant::now();
    let done = loop {
        match cuEventQuery(e) {
            CUDA_SUCCESS => break true,
            CUDA_ERROR_NOT_READY if t.elapsed() < Duration::from_secs(2) => {
                std::thread::sleep(Duration::from_millis(5))
            }
            CUDA_ERROR_NOT_READY => break false,
            other => panic!("cuEventQuery: {other}"),
        }
    };
    assert_eq!(cuEventDestroy_v2(e), CUDA_SUCCESS);
    done
}

const NULL: CUstream = std::ptr::null_mut();

#[test]
fn the_null_stream_orders_with_blocking_streams_only() {
    bind();
    let blocking = stream(0);
    let non_blocking = stream(CU_STREAM_NON_BLOCKING);

    // Work held on a non-blocking stream does not hold the null stream.
    let gate = hold(non_blocking);
    assert!(
        completes(NULL),
        "the null stream waited for a non-blocking stream"
    );
    drop(gate);
    assert_eq!(cuStreamSynchronize(non_blocking), CUDA_SUCCESS);

    // Work held on a blocking stream holds work queued on the null stream after it.
    let gate = hold(blocking);
    assert!(
        !completes(NULL),
        "the null stream ran ahead of a blocking stream"
    );
    drop(gate);
    assert_eq!(cuCtxSynchronize(), CUDA_SUCCESS);

    // Work held on the null stream holds a blocking stream's later work, not a
    // non-blocking one's.
    let gate = hold(NULL);
    assert!(
        !completes(blocking),
        "a blocking stream ran ahead of the null stream"
    );
    assert!(
        completes(non_blocking),
        "a non-blocking stream waited for the null stream"
    );
    drop(gate);
    assert_eq!(cuCtxSynchronize(), CUDA_SUCCESS);
    assert!(completes(blocking) && completes(NULL));

    // A blocking stream's work queued before the null stream's is not ordered after it.
    let gate = hold(blocking);
    let null_gate = hold(NULL);
    drop(gate);
    assert_eq!(cuStreamSynchronize(blocking), CUDA_SUCCESS);
    drop(null_gate);
    assert_eq!(cuCtxSynchronize(), CUDA_SUCCESS);

    assert_eq!(cuStreamDestroy_v2(blocking), CUDA_SUCCESS);
    assert_eq!(cuStreamDestroy_v2(non_blocking), CUDA_SUCCESS);
}
