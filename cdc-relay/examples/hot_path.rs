//! The hot path (`tests/hot_path`) with the system allocator, for counting
//! the instructions it runs per event under callgrind, which counts the
//! same for the same binary however busy the machine is:
//! `tests/instructions-per-event.sh` runs it at two sizes and divides the
//! difference (start-up and warm-up cancel out).
//!
//! Usage: `hot_path [EVENTS]` (a multiple of 10; default 10,000), after a
//! 500-event warm-up. Prints the number of events delivered.

#[path = "../tests/hot_path/mod.rs"]
mod hot_path;

fn main() {
    let events: u64 = match std::env::args().nth(1) {
        None => 10_000,
        Some(arg) => match arg.parse() {
            Ok(n) if n > 0 && n % hot_path::PER_TX == 0 => n,
            _ => {
                eprintln!(
                    "hot_path: EVENTS must be a positive multiple of {}, not {arg:?}",
                    hot_path::PER_TX
                );
                std::process::exit(2);
            }
        },
    };
    let counted = hot_path::run(500, events, || 0);
    println!(
        "{events} events delivered, {} tasks spawned meanwhile",
        counted.tasks_spawned
    );
}
