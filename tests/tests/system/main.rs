//! System tests.

mod chaos;
mod cli;
mod failures;
mod faults;
mod harness;
mod relay;
mod services;
mod stream;
