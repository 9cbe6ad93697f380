//! System tests.

mod harness;
mod relay;
mod services;
