//! Workspace-level tests live in `tests/tests/`. The README's Rust examples are compiled and run
//! here as doc tests, so the library usage it shows cannot drift from the code.
// The README's links are paths in the repository (`[`models/`](models)`), which rustdoc would read
// as links to Rust items; `tests/docs_links.rs` checks that every one of them resolves.
#![allow(rustdoc::broken_intra_doc_links)]
#![doc = include_str!("../../README.md")]
