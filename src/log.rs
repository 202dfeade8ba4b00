//! Library log sink: a host-installed callback, else stderr for warnings and errors.

use std::sync::Mutex;
use std::sync::atomic::{AtomicI32, Ordering};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[repr(i32)]
pub enum Level {
    Error = 0,
    Warn = 1,
    Info = 2,
    Debug = 3,
}

/// A host log sink: receives the level and one message.
pub type Sink = Box<dyn Fn(Level, &str) + Send + Sync>;

struct Logger {
    sink: Option<Sink>,
    max_level: Level,
}

static LOGGER: Mutex<Logger> = Mutex::new(Logger {
    sink: None,
    max_level: Level::Warn,
});

/// `LOGGER.max_level` as an integer, readable without the lock (see [`enabled`]).
static MAX_LEVEL: AtomicI32 = AtomicI32::new(Level::Warn as i32);

/// Installs (or with None removes) the host sink and the most verbose level it receives.
pub fn set_sink(sink: Option<Sink>, max_level: Level) {
    let mut l = LOGGER.lock().unwrap_or_else(|p| p.into_inner());
    l.sink = sink;
    l.max_level = max_level;
    MAX_LEVEL.store(max_level as i32, Ordering::Relaxed);
}

/// Whether a message at `level` would reach the sink now: check it before formatting
/// anything costly (per-tensor detail). One atomic load, no lock.
pub fn enabled(level: Level) -> bool {
    (level as i32) <= MAX_LEVEL.load(Ordering::Relaxed)
}

pub fn log(level: Level, msg: &str) {
    let l = LOGGER.lock().unwrap_or_else(|p| p.into_inner());
    if level > l.max_level {
        return;
    }
    match &l.sink {
        Some(s) => s(level, msg),
        None => eprintln!("dsv4 [{level:?}]: {msg}"),
    }
}

pub fn warn(msg: &str) {
    log(Level::Warn, msg)
}

pub fn info(msg: &str) {
    log(Level::Info, msg)
}

pub fn debug(msg: &str) {
    log(Level::Debug, msg)
}
