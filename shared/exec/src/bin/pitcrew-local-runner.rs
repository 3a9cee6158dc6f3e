//! The local runner alone ([`pitcrew_exec::runner`]): what `pitcrew` serves as when started
//! with `__pitcrew-local-runner`, for the tests and for any program that embeds the executor.

fn main() {
    std::process::exit(pitcrew_exec::runner::serve());
}
