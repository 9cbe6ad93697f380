//! System tests.

mod cli;
mod harness;
mod relay;
mod services;
mod stream;
