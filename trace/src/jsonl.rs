//! JSONL placeholder.
