//! The local watchdog alone ([`pitcrew_exec::watchdog`]): what `pitcrew` serves as when
//! started with `__pitcrew-watchdog`, for the tests and for any program that embeds the
//! executor.

fn main() {
    std::process::exit(pitcrew_exec::watchdog::serve());
}
