//! System tests.

mod cli;
mod faults;
mod harness;
mod relay;
mod services;
mod stream;
