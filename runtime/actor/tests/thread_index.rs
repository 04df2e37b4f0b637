//! `thread_index`: an exited thread's number goes to the next new thread (alone in its test
//! binary, so no other thread takes numbers meanwhile).

#![cfg(not(loom))]

use gpualloc_actor::thread_slots::thread_index;

#[test]
fn an_exited_threads_index_is_reused_by_the_next_thread() {
    let main = thread_index().unwrap();
    let first = std::thread::spawn(|| thread_index().unwrap())
        .join()
        .unwrap();
    let second = std::thread::spawn(|| thread_index().unwrap())
        .join()
        .unwrap();
    assert_ne!(first, main);
    assert_eq!(second, first, "the first thread's number came back");
    // Both hold their numbers at the barrier at once.
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
    let live: Vec<_> = (0..2)
        .map(|_| {
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let i = thread_index().unwrap();
                barrier.wait();
                i
            })
        })
        .collect();
    let ab: Vec<usize> = live.into_iter().map(|t| t.join().unwrap()).collect();
    let (a, b) = (ab[0], ab[1]);
    assert_ne!(a, b, "two live threads never share a number");
    assert!(a.max(b) <= first + 1, "numbers stay small: {a}, {b}");
}
