//! gpualloc's tools, out of the library package: the main job, `cargo run --release --example
//! serve` (`examples/serve/`), and the figures, `cargo run --release --bin bench`
//! (`src/bin/bench/`). Both use the public API of `gpualloc` only. The workspace's default
//! members include this package, so both commands work from the repository's root.
//!
//! The library target is empty: it exists so the package has a root.
