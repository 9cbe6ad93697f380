//! System tests.

mod harness;
mod relay;
