//! The `read_probe` kernel family (kernels/read_probe.cu): reads a buffer once in 16-byte
//! streaming loads and does nothing else, so `dsv4 bench dense --read-probe` can time what
//! reading a projection's bytes costs at its size under the gemv's own timing (the size's
//! practical ceiling: launch, first-byte latency and tail included), and, with
//! `read_probe_rows_kernel`, what reading it in the gemv's own order of addresses costs without
//! the gemv's arithmetic ([`RowOrder`]). Benches only: no model code may use it.

use super::stream::BorrowedStream;
use super::{Context, DevicePtr};
use crate::cuda::kernels::need;
use crate::error::{Error, Result, Status};

crate::kernel_family! {
    pub const SOURCE = "read_probe", include_str!("../../kernels/read_probe.cu");

    #[smem(MAX_SMEM)]
    #[pdl(true)]
    fn read_probe_u2_kernel(p: *const u8, words: i64, sink: *mut u32);
    #[smem(MAX_SMEM)]
    #[pdl(true)]
    fn read_probe_u4_kernel(p: *const u8, words: i64, sink: *mut u32);
    #[smem(MAX_SMEM)]
    #[pdl(true)]
    fn read_probe_u8_kernel(p: *const u8, words: i64, sink: *mut u32);
    #[smem(MAX_SMEM)]
    #[pdl(true)]
    fn read_probe_u16_kernel(p: *const u8, words: i64, sink: *mut u32);
    #[smem(MAX_SMEM)]
    #[pdl(true)]
    fn read_probe_rows_kernel(w: *const u8, row_bytes: i32, rows: i32, order: i32, sink: *mut u32);
}

crate::launchers! {
    /// The probe's entry points, resolved from a loaded registry.
    pub struct ReadProbe {
        u2: read_probe_u2_kernel,
        u4: read_probe_u4_kernel,
        u8: read_probe_u8_kernel,
        u16: read_probe_u16_kernel,
        rows: read_probe_rows_kernel,
    }
}

/// The most dynamic shared memory a block may ask for on sm_90 (227 KiB).
pub const MAX_SMEM: u32 = 227 * 1024;
/// Shared memory an SM has for blocks on sm_90, each block also taking 1 KiB the system reserves.
const SM_SMEM: u32 = 228 * 1024;

/// The orders `read_probe_rows_kernel` reads a row tile in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowOrder {
    /// fd_gemv's: a warp load covers half of each of 8 rows' 128-byte lines.
    Gemv = 0,
    /// The same with the L2::128B fetch-size hint.
    GemvL2Line = 1,
    /// The same with the L2::256B fetch-size hint.
    GemvL2Pair = 2,
    /// A warp load covers four whole 128-byte lines.
    WholeLines = 3,
}

/// Every [`RowOrder`] with its name in the bench's JSON.
pub const ROW_ORDERS: [(RowOrder, &str); 4] = [
    (RowOrder::Gemv, "gemv"),
    (RowOrder::GemvL2Line, "gemv_l2_128B"),
    (RowOrder::GemvL2Pair, "gemv_l2_256B"),
    (RowOrder::WholeLines, "whole_lines"),
];

/// Threads of a probe block.
pub const THREADS: u32 = 256;
/// Loads a thread keeps in flight, one entry point each.
pub const IN_FLIGHT: [usize; 4] = [2, 4, 8, 16];

impl ReadProbe {
    /// Reads the first `bytes` (a multiple of 16) of `p` with `blocks` blocks of [`THREADS`],
    /// each thread `in_flight` loads at a time (one of [`IN_FLIGHT`]); `sink` holds a u32 a
    /// block and is written only by chance (never, on random data). `exclusive_per_sm`: ask for
    /// enough unused shared memory that at most that many blocks fit on an SM.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        ctx: &Context,
        p: DevicePtr,
        bytes: usize,
        in_flight: usize,
        blocks: u32,
        sink: DevicePtr,
        exclusive_per_sm: Option<u32>,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "read_probe";
        if !bytes.is_multiple_of(16) || !p.addr().is_multiple_of(16) || blocks == 0 {
            return Err(Error::new(
                Status::InvalidArgument,
                format!("{K}: {bytes} bytes at {:#x}, {blocks} blocks", p.addr()),
            ));
        }
        need(K, "p", p, bytes)?;
        need(K, "sink", sink, 4 * blocks as usize)?;
        let _g = ctx.enter()?;
        let words = (bytes / 16) as i64;
        let smem = exclusive_per_sm.map_or(0, |n| (SM_SMEM / n.max(1) - 1024).min(MAX_SMEM));
        macro_rules! probe {
            ($field:ident, $kernel:ident) => {
                self.$field.launch(
                    blocks,
                    THREADS,
                    smem,
                    stream,
                    $kernel::Args { p, words, sink },
                )
            };
        }
        match in_flight {
            2 => probe!(u2, read_probe_u2_kernel),
            4 => probe!(u4, read_probe_u4_kernel),
            8 => probe!(u8, read_probe_u8_kernel),
            16 => probe!(u16, read_probe_u16_kernel),
            n => Err(Error::new(
                Status::InvalidArgument,
                format!("{K}: {n} loads in flight"),
            )),
        }
    }

    /// Reads `rows` rows of `row_bytes` (a multiple of 128) at `w` as fd_gemv's warps do (FP8, one
    /// slice), in one of [`ROW_ORDERS`] (kernels/read_probe.cu `read_probe_rows_kernel`), a block a
    /// 128-row tile, at most
    /// `per_sm` blocks an SM (shared memory it does not use keeps the rest out, as the gemv's
    /// registers do).
    #[allow(clippy::too_many_arguments)]
    pub fn run_rows(
        &self,
        ctx: &Context,
        w: DevicePtr,
        row_bytes: usize,
        rows: usize,
        order: RowOrder,
        per_sm: u32,
        sink: DevicePtr,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "read_probe_rows_kernel";
        if row_bytes == 0 || !row_bytes.is_multiple_of(128) || rows == 0 || per_sm == 0 {
            return Err(Error::new(
                Status::InvalidArgument,
                format!("{K}: {rows} rows of {row_bytes} bytes, {per_sm} blocks an SM"),
            ));
        }
        need(K, "w", w, row_bytes * rows)?;
        let blocks = rows.div_ceil(128);
        need(K, "sink", sink, 4 * blocks)?;
        let _g = ctx.enter()?;
        let smem = (SM_SMEM / per_sm - 1024).min(MAX_SMEM);
        let args = read_probe_rows_kernel::Args {
            w,
            row_bytes: row_bytes as i32,
            rows: rows as i32,
            order: order as i32,
            sink,
        };
        self.rows.launch(blocks as u32, THREADS, smem, stream, args)
    }
}
