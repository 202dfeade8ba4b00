//! Writing validated weight values into the device arena with no host copy of the weights
//! (DESIGN.md §2): a bounded pool of pinned staging buffers, filled by worker threads and
//! copied out on the host's stream.
//!
//! A weight is cut into row chunks that fit one buffer (rows.rs: FP8 chunks start at a
//! block row). Each worker takes the next chunk, waits until a free buffer's last copy has
//! left it (its event), produces the chunk there in the weight's storage layout (reading the
//! memory-mapped checkpoint, decoding, quantizing), enqueues the copy to the chunk's place in
//! the arena and records the buffer's event. So reading/converting on up to `threads` cores
//! overlaps the DMA of the chunks before, and host memory is the pool's size whatever the
//! model's. The pool lives from the first write until finalize (or the end of a refit).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};

use cudarc::driver::sys;

use crate::cuda::arena::memcpy_htod_async;
use crate::cuda::check;
use crate::cuda::context::Context;
use crate::cuda::device_model::WeightDev;
use crate::cuda::stream::BorrowedStream;
use crate::error::{Error, Result, Status};
use crate::weights::rows::Geometry;
use crate::weights::table::WeightTable;
use crate::weights::values::{Progress, WeightValues};

/// Default total size of the staging buffers (`EngineOptions::staging_bytes` = 0).
pub const DEFAULT_STAGING_BYTES: usize = 256 << 20;

/// One pinned buffer and the event recorded after the last copy out of it.
struct Buffer {
    ptr: *mut u8,
    event: sys::CUevent,
}

/// Page-locked staging buffers of equal size.
pub struct StagingPool {
    buffers: Vec<Buffer>,
    buffer_bytes: usize,
    ctx: Context,
}

// SAFETY: the raw pointers are owned by the pool; each buffer is handed to one worker at a
// time (the free list below), and CUDA handles may be used from any thread.
unsafe impl Send for StagingPool {}
unsafe impl Sync for StagingPool {}

impl StagingPool {
    /// `total_bytes` of pinned memory in `count` buffers (cuMemHostAlloc), with an event each.
    pub fn new(ctx: &Context, total_bytes: usize, count: usize) -> Result<StagingPool> {
        let _g = ctx.enter()?;
        let count = count.max(2);
        // 4 KiB multiples keep every buffer (and so every chunk's f32 scales) aligned.
        let buffer_bytes = (total_bytes / count).max(4096) / 4096 * 4096;
        let mut pool = StagingPool {
            buffers: Vec::with_capacity(count),
            buffer_bytes,
            ctx: ctx.clone(),
        };
        for _ in 0..count {
            let mut ptr = std::ptr::null_mut();
            // SAFETY: writes one host pointer.
            check(
                format!("cuMemHostAlloc({buffer_bytes} bytes) for a weight staging buffer"),
                unsafe { sys::cuMemHostAlloc(&mut ptr, buffer_bytes, 0) },
            )?;
            // From here on, Drop frees it if a later step fails.
            pool.buffers.push(Buffer {
                ptr: ptr.cast(),
                event: std::ptr::null_mut(),
            });
            let b = pool.buffers.last_mut().expect("just pushed");
            // SAFETY: writes one handle.
            check("cuEventCreate", unsafe {
                sys::cuEventCreate(
                    &mut b.event,
                    sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
                )
            })?;
        }
        Ok(pool)
    }

    /// Pinned bytes held.
    pub fn bytes(&self) -> usize {
        self.buffer_bytes * self.buffers.len()
    }

    /// Writes every target of `values` into its device copy `weights[i]` (values, then f32
    /// scales), on `stream`, and waits for the copies. A weight whose smallest chunk exceeds a
    /// buffer is refused before anything is written.
    pub fn upload(
        &self,
        table: &WeightTable,
        weights: &[WeightDev],
        values: &dyn WeightValues,
        progress: &Progress,
        stream: BorrowedStream,
    ) -> Result<()> {
        let mut chunks = Vec::new();
        for i in values.targets() {
            let g = Geometry::of(table.entry(i));
            if g.min_chunk_bytes() > self.buffer_bytes {
                return Err(Error::new(
                    Status::InvalidArgument,
                    format!(
                        "weight `{}`: one chunk of it takes {} bytes but a staging buffer holds {}; raise staging_bytes",
                        table.name(i),
                        g.min_chunk_bytes(),
                        self.buffer_bytes
                    ),
                ));
            }
            chunks.extend(g.chunks(self.buffer_bytes).into_iter().map(|r| (i, g, r)));
        }
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(16)
            .min(self.buffers.len())
            .min(chunks.len().max(1));
        let work = Mutex::new(chunks.into_iter());
        let free = FreeList::new(self.buffers.len());
        let failed = Mutex::new(None::<Error>);
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    let run = || -> Result<()> {
                        let _g = self.ctx.enter()?;
                        loop {
                            if stop.load(Ordering::Relaxed) {
                                return Ok(());
                            }
                            let next = work.lock().unwrap_or_else(|e| e.into_inner()).next();
                            let Some((i, g, rows)) = next else {
                                return Ok(());
                            };
                            let k = free.take();
                            let r =
                                self.copy_chunk(k, table, &weights[i], values, i, g, rows, stream);
                            free.put(k);
                            let last = r?;
                            progress.add(usize::from(last.0), last.1);
                        }
                    };
                    if let Err(e) = run() {
                        stop.store(true, Ordering::Relaxed);
                        failed
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get_or_insert(e);
                    }
                });
            }
        });
        // Every copy enqueued must finish before the buffers are reused or freed, error or not.
        let _g = self.ctx.enter()?;
        let synced = stream.synchronize();
        if let Some(e) = failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(e);
        }
        synced
    }

    /// Produces rows `rows` of weight `i` in buffer `k` and enqueues their copies; returns
    /// (whether this was the weight's last chunk, bytes copied).
    #[allow(clippy::too_many_arguments)]
    fn copy_chunk(
        &self,
        k: usize,
        table: &WeightTable,
        dw: &WeightDev,
        values: &dyn WeightValues,
        i: usize,
        g: Geometry,
        rows: std::ops::Range<usize>,
        stream: BorrowedStream,
    ) -> Result<(bool, u64)> {
        let b = &self.buffers[k];
        // SAFETY: the event was recorded after the last copy out of this buffer (or never).
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(b.event)
        })?;
        let (drange, srange) = (g.data_range(&rows), g.scale_range(&rows));
        let sbytes = 4 * srange.len();
        debug_assert!(sbytes + drange.len() <= self.buffer_bytes);
        // SAFETY: the buffer is this worker's alone until it is put back, and its last copy
        // has completed (waited above); scales come first, so they are 4-byte aligned (the
        // buffer is page-aligned), and both parts lie within its `buffer_bytes`.
        let (scales, data) = unsafe {
            (
                std::slice::from_raw_parts_mut(b.ptr.cast::<f32>(), srange.len()),
                std::slice::from_raw_parts_mut(b.ptr.add(sbytes), drange.len()),
            )
        };
        values.fill(table, i, rows.clone(), data, scales);
        if rows.end == g.rows {
            values.written(i);
        }
        let dst = dw.data.slice(drange.start, drange.len())?;
        // SAFETY: pinned memory, untouched until the event recorded below has completed.
        unsafe { memcpy_htod_async(dst, data.as_ptr(), data.len(), stream)? };
        if sbytes > 0 {
            let s = dw.scales.ok_or_else(|| {
                Error::new(
                    Status::Internal,
                    format!(
                        "quantized weight `{}` has no device scale buffer",
                        table.name(i)
                    ),
                )
            })?;
            let dst = s.slice(srange.start * 4, sbytes)?;
            // SAFETY: as above.
            unsafe { memcpy_htod_async(dst, b.ptr, sbytes, stream)? };
        }
        // SAFETY: records on the stream the copies were enqueued on.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(b.event, stream.raw())
        })?;
        Ok((rows.end == g.rows, (drange.len() + sbytes) as u64))
    }
}

impl Drop for StagingPool {
    fn drop(&mut self) {
        if let Ok(_g) = self.ctx.enter() {
            for b in &self.buffers {
                // SAFETY: handles made in `new` (a null event is skipped), each freed once,
                // after its last copy has completed.
                unsafe {
                    if !b.event.is_null() {
                        let _ = sys::cuEventSynchronize(b.event);
                        let _ = sys::cuEventDestroy_v2(b.event);
                    }
                    let _ = sys::cuMemFreeHost(b.ptr.cast());
                }
            }
        }
    }
}

/// Indices of the buffers no worker holds.
struct FreeList {
    free: Mutex<Vec<usize>>,
    ready: Condvar,
}

impl FreeList {
    fn new(n: usize) -> FreeList {
        FreeList {
            free: Mutex::new((0..n).rev().collect()),
            ready: Condvar::new(),
        }
    }

    /// A free buffer, waiting for one if all are taken.
    fn take(&self) -> usize {
        let mut f = self.free.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(k) = f.pop() {
                return k;
            }
            f = self.ready.wait(f).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn put(&self, k: usize) {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).push(k);
        self.ready.notify_one();
    }
}
