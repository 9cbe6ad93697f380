//! System tests.

mod harness;
