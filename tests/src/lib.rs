//! Workspace-level tests live in `tests/tests/`. The README's Rust examples are compiled and run
//! here as doc tests, so the library usage it shows cannot drift from the code.
#![doc = include_str!("../../README.md")]
