//! The operator surface of `cdc-relay`: setup, status, start-up errors.
//! One file a command's topic:
//!
//! | file | what |
//! |---|---|
//! | `setup.rs` | `setup`: idempotence, publication, columns, warnings, privileges |
//! | `startup.rs` | `run` before it streams: configuration errors, missing slot, `--create-slot`, `version` |
//! | `slots.rs` | slots as `status` and `run` see them |

mod setup;
mod slots;
mod startup;
