//! System tests.

mod chaos;
mod cli;
mod harness;
mod infra_faults;
mod observability;
mod relay;
mod services;
mod sink_failures;
mod stream;
