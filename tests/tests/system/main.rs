//! System tests.

mod chaos;
mod cli;
mod failures;
mod faults;
mod harness;
mod observability;
mod relay;
mod services;
mod stream;
