//! RMM CSV placeholder.
