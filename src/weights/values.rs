//! Validated weight values on their way to a backend's copy.
//!
//! A load or a refit first *plans* (load.rs, dummy.rs): every check happens there, and the
//! result is a [`WeightValues`], which can produce the bytes of whole weights row chunk by row
//! chunk, directly in each weight's storage layout (rows.rs), and cannot fail. A backend then
//! *writes* them: the CPU store one weight per chunk in place ([`write_to_store`]), the CUDA
//! backend through a bounded set of pinned staging buffers into its arena
//! (src/cuda/upload.rs). So host memory during a CUDA load is bounded by the staging size, not
//! by the model. [`Progress`] reports on either.

use std::ops::Range;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::weights::rows::Geometry;
use crate::weights::store::WeightStore;
use crate::weights::table::WeightTable;

/// Values of whole weights, produced on demand in their storage layout.
pub trait WeightValues: Sync {
    /// The weights this writes, each entirely, in the order to write them (a checkpoint's:
    /// file order, so the files are read front to back).
    fn targets(&self) -> Vec<usize>;

    /// Writes rows `rows` of weight `dst` (one of [`WeightValues::targets`]; a chunk of
    /// [`Geometry::chunks`]) into `data` ([`Geometry::data_range`]'s bytes) and `scales`
    /// ([`Geometry::scale_range`]'s f32 scales, empty for unquantized storage).
    fn fill(
        &self,
        table: &WeightTable,
        dst: usize,
        rows: Range<usize>,
        data: &mut [u8],
        scales: &mut [f32],
    );

    /// Called once weight `dst` has been produced entirely: a memory-mapped checkpoint drops
    /// its consumed pages from the process. Default: nothing.
    fn written(&self, _dst: usize) {}
}

/// Writes `values` into the host store, every weight as one chunk, on all cores.
pub fn write_to_store(store: &mut WeightStore, values: &dyn WeightValues, progress: &Progress) {
    let (table, tensors) = store.table_and_tensors_mut();
    let targets = values.targets();
    // Hand out each target's buffer once (targets are distinct weights).
    let mut parts: Vec<Option<(&mut [u8], &mut [f32])>> = tensors
        .iter_mut()
        .map(|t| Some(t.data.parts_mut()))
        .collect();
    let mut work = Vec::with_capacity(targets.len());
    for &i in &targets {
        if let Some(p) = parts.get_mut(i).and_then(Option::take) {
            work.push((i, p));
        }
    }
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(16)
        .min(work.len().max(1));
    let queue = Mutex::new(work.into_iter());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let next = queue.lock().unwrap_or_else(|e| e.into_inner()).next();
                    let Some((i, (data, scales))) = next else {
                        break;
                    };
                    let rows = 0..Geometry::of(table.entry(i)).rows;
                    values.fill(table, i, rows, data, scales);
                    values.written(i);
                    progress.add(1, table.entry(i).layout.bytes() as u64);
                }
            });
        }
    });
}

/// Progress of a long write, logged at Info every few seconds so that a 100+ GB load never
/// looks hung: `<call> progress: weights=<done>/<total> bytes=<done>/<total> secs=<S> gbps=<G>`.
pub struct Progress {
    call: &'static str,
    total_weights: usize,
    total_bytes: u64,
    weights: AtomicUsize,
    bytes: AtomicU64,
    start: Instant,
    last: Mutex<Instant>,
    every: Duration,
}

impl Progress {
    /// Progress of writing `targets` of `table`, reported as `call`.
    pub fn new(call: &'static str, table: &WeightTable, targets: &[usize]) -> Progress {
        let now = Instant::now();
        Progress {
            call,
            total_weights: targets.len(),
            total_bytes: targets
                .iter()
                .map(|&i| table.entry(i).layout.bytes() as u64)
                .sum(),
            weights: AtomicUsize::new(0),
            bytes: AtomicU64::new(0),
            start: now,
            last: Mutex::new(now),
            every: Duration::from_secs(2),
        }
    }

    /// Counts `weights` finished weights and `bytes` written; logs when the last line is
    /// older than the interval.
    pub fn add(&self, weights: usize, bytes: u64) {
        self.weights.fetch_add(weights, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        if !crate::log::enabled(crate::log::Level::Info) {
            return;
        }
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if last.elapsed() < self.every {
            return;
        }
        *last = Instant::now();
        drop(last);
        crate::log::info(&self.line());
    }

    /// The progress line now.
    pub fn line(&self) -> String {
        let secs = self.start.elapsed().as_secs_f64();
        let bytes = self.bytes.load(Ordering::Relaxed);
        format!(
            "{} progress: weights={}/{} bytes={}/{} secs={secs:.3} gbps={:.3}",
            self.call,
            self.weights.load(Ordering::Relaxed),
            self.total_weights,
            bytes,
            self.total_bytes,
            if secs > 0.0 {
                bytes as f64 / secs / 1e9
            } else {
                0.0
            }
        )
    }

    /// Bytes written so far.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The progress line counts weights and bytes of the targets, as load_report.rs documents.
    #[test]
    fn progress_line_counts_weights_and_bytes() {
        let cfg = crate::config::ModelConfig::tiny_default();
        let table = WeightTable::new(&cfg, crate::weights::WeightFormat::AsStored).unwrap();
        let targets = [0, 1, 2];
        let total: u64 = targets
            .iter()
            .map(|&i| table.entry(i).layout.bytes() as u64)
            .sum();
        let p = Progress::new("dsv4_load", &table, &targets);
        p.add(2, 1000);
        let line = p.line();
        assert!(
            line.starts_with(&format!(
                "dsv4_load progress: weights=2/3 bytes=1000/{total} secs="
            )),
            "{line}"
        );
        assert!(line.contains(" gbps="), "{line}");
        assert_eq!(p.bytes(), 1000);
    }
}
