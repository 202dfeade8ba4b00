//! The device layout of the KV state (kernels/kv_pages.cuh reads and writes it; the formulas
//! here and there are the same and tests/gpu_attention.rs decodes the device state with this
//! file's layout, bit for bit against the CPU's f32 state).
//!
//! - **Rows.** In `official` numerics every stored row is already in the official precision
//!   (MODEL.md §6.5, docs/numerics.md): a KV row's nope channels are e4m3 values times a
//!   UE8M0 scale per 64, its RoPE channels BF16; an indexer key is e2m1 values times a UE8M0
//!   scale per 32. So the state keeps the codes ([`KvFormat::Official`]): 448 e4m3 bytes + 64
//!   BF16 + 7 scale bytes for a Flash KV row (584 B against 2048 B of f32), 64 nibble bytes +
//!   4 scale bytes for an indexer key (68 B against 512 B). Decoding gives back the f32 values
//!   the reference stores, bit for bit: the writers re-derive each block's scale from values
//!   that are already codes times a power of two, which gives a scale no larger than the
//!   original and codes that are the original ones times a power of two, so every value is
//!   reproduced exactly (kv_pages.cuh `kv_store_row`). `exact` numerics keep f32 rows.
//! - **Pages.** Compressed entries and indexer keys live in pages of [`KV_PAGE`] rows: first
//!   the page's rows (16-byte aligned, so vector and bulk copies work), then its per-row
//!   scale records. A slot reaches its pages through an int32 block table `[slot, page]` in
//!   device memory. Each slot owns its pages statically for now (table entry = slot *
//!   pages_per_slot + page, written when the engine is finalized); a pool that hands pages to sequences as they
//!   grow changes the table, not the kernels. The table is shared by every buffer with the
//!   same entry count per slot (one per compression ratio).
//! - **The window ring** (W rows per slot, position p at row p mod W) uses the same row
//!   format in pages of its own, without a table (slot s owns pages s * ceil(W / KV_PAGE) ..).

use crate::cuda::arena::DevicePtr;
use crate::cuda::kernels::need;
use crate::error::{Error, Result, Status};
use crate::options::Numerics;
use crate::weights::dtype::{E4M3_LUT, FP4_LUT, bf16_to_f32, e8m0_to_f32};

/// Rows per page.
pub const KV_PAGE: usize = 64;
/// Nope channels per UE8M0 scale of a KV row (precision.rs `kv_nope_sim`).
pub const KV_FP8_BLOCK: usize = crate::reference::precision::KV_BLOCK;
/// Channels per UE8M0 scale of an indexer key (precision.rs `index_sim`).
pub const KV_FP4_BLOCK: usize = crate::reference::precision::INDEX_BLOCK;
/// Alignment of a row's bytes within a page (16: vector loads, bulk copies).
pub const KV_ROW_ALIGN: usize = 16;
/// Alignment of a row's scale record.
pub const KV_SCALE_ALIGN: usize = 4;

/// How rows store their values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvFormat {
    /// f32 values (exact numerics).
    F32,
    /// The official precision's codes: see the module doc.
    Official,
}

impl KvFormat {
    /// The format the state takes under `numerics`.
    pub fn for_numerics(numerics: Numerics) -> KvFormat {
        match numerics {
            Numerics::Exact => KvFormat::F32,
            Numerics::Official => KvFormat::Official,
        }
    }

    /// The format the kernels' `official` flag implies.
    pub fn for_official(official: bool) -> KvFormat {
        if official {
            KvFormat::Official
        } else {
            KvFormat::F32
        }
    }
}

/// What a row holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowKind {
    /// A KV vector (window or compressed entry): `nope` channels, then RoPE channels.
    Kv { nope: usize },
    /// An indexer key (Hadamard-rotated, FP4-simulated as a whole).
    IndexKey,
}

/// The layout of one kind of row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvRows {
    pub format: KvFormat,
    pub kind: RowKind,
    /// Values per row.
    pub dim: usize,
}

impl KvRows {
    /// KV vectors of `dim` values whose first `nope` are the nope channels.
    pub fn kv(format: KvFormat, dim: usize, nope: usize) -> KvRows {
        KvRows {
            format,
            kind: RowKind::Kv { nope },
            dim,
        }
    }

    /// Indexer keys of `dim` values.
    pub fn index_keys(format: KvFormat, dim: usize) -> KvRows {
        KvRows {
            format,
            kind: RowKind::IndexKey,
            dim,
        }
    }

    /// Bytes of a row's values (padded to [`KV_ROW_ALIGN`]).
    pub fn row_bytes(&self) -> usize {
        let raw = match (self.format, self.kind) {
            (KvFormat::F32, _) => self.dim * 4,
            (KvFormat::Official, RowKind::Kv { nope }) => nope + 2 * (self.dim - nope),
            (KvFormat::Official, RowKind::IndexKey) => self.dim.div_ceil(2),
        };
        raw.next_multiple_of(KV_ROW_ALIGN)
    }

    /// Bytes of a row's scale record (padded to [`KV_SCALE_ALIGN`]; 0 for f32 rows).
    pub fn scale_bytes(&self) -> usize {
        match (self.format, self.kind) {
            (KvFormat::F32, _) => 0,
            (KvFormat::Official, RowKind::Kv { nope }) => {
                nope.div_ceil(KV_FP8_BLOCK).next_multiple_of(KV_SCALE_ALIGN)
            }
            (KvFormat::Official, RowKind::IndexKey) => self
                .dim
                .div_ceil(KV_FP4_BLOCK)
                .next_multiple_of(KV_SCALE_ALIGN),
        }
    }

    /// Bytes of one page: its rows, then their scale records (a multiple of 256).
    pub fn page_bytes(&self) -> usize {
        KV_PAGE * (self.row_bytes() + self.scale_bytes())
    }

    /// Pages that hold `rows` rows.
    pub fn pages_for(rows: usize) -> usize {
        rows.div_ceil(KV_PAGE)
    }

    /// Bytes one stored row takes, its scale record included.
    pub fn bytes_per_row(&self) -> usize {
        self.row_bytes() + self.scale_bytes()
    }

    /// Row `r` of `page` (one page's bytes) as f32 values, as the kernels decode it.
    pub fn decode_row(&self, page: &[u8], r: usize) -> Vec<f32> {
        let row = &page[r * self.row_bytes()..][..self.row_bytes()];
        let sc = &page[KV_PAGE * self.row_bytes() + r * self.scale_bytes()..][..self.scale_bytes()];
        match (self.format, self.kind) {
            (KvFormat::F32, _) => row
                .chunks_exact(4)
                .take(self.dim)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            (KvFormat::Official, RowKind::Kv { nope }) => (0..self.dim)
                .map(|c| {
                    if c < nope {
                        E4M3_LUT[row[c] as usize] * e8m0_to_f32(sc[c / KV_FP8_BLOCK])
                    } else {
                        let i = nope + 2 * (c - nope);
                        bf16_to_f32(u16::from_le_bytes([row[i], row[i + 1]]))
                    }
                })
                .collect(),
            (KvFormat::Official, RowKind::IndexKey) => (0..self.dim)
                .map(|c| {
                    let b = row[c / 2];
                    let nibble = if c % 2 == 0 { b & 0x0f } else { b >> 4 };
                    FP4_LUT[nibble as usize] * e8m0_to_f32(sc[c / KV_FP4_BLOCK])
                })
                .collect(),
        }
    }
}

/// One paged buffer on the device: `pool` holds `num_slots * pages_per_slot` pages; a slot's
/// page `i` is `table[slot * pages_per_slot + i]`, or `slot * pages_per_slot + i` without a
/// table (the window ring).
#[derive(Clone, Copy, Debug)]
pub struct KvPagesDev {
    pub pool: DevicePtr,
    pub table: Option<DevicePtr>,
    pub pages_per_slot: usize,
    pub rows: KvRows,
}

impl KvPagesDev {
    /// Checks, before a launch, that the buffer holds `rows_per_slot` rows for each of
    /// `num_slots` slots in the format `official` implies.
    pub fn check(
        &self,
        who: &str,
        what: &str,
        num_slots: usize,
        rows_per_slot: usize,
        official: bool,
    ) -> Result<()> {
        if self.rows.format != KvFormat::for_official(official) {
            return Err(Error::new(
                Status::Internal,
                format!(
                    "{who}: `{what}` is stored {:?}, the launch's numerics need {:?}",
                    self.rows.format,
                    KvFormat::for_official(official)
                ),
            ));
        }
        if self.pages_per_slot < KvRows::pages_for(rows_per_slot) {
            return Err(Error::new(
                Status::Internal,
                format!(
                    "{who}: `{what}` has {} pages per slot, {rows_per_slot} rows need {}",
                    self.pages_per_slot,
                    KvRows::pages_for(rows_per_slot)
                ),
            ));
        }
        let pages = num_slots * self.pages_per_slot;
        need(who, what, self.pool, pages * self.rows.page_bytes())?;
        // (Every launch checks this: the message is formatted only on failure.)
        if let Some(t) = self.table
            && t.bytes() < pages * 4
        {
            return Err(Error::new(
                Status::Internal,
                format!(
                    "{who}: `{what}` block table holds {} bytes, needs {}",
                    t.bytes(),
                    pages * 4
                ),
            ));
        }
        Ok(())
    }

    /// Rows `0..count` of `slot` decoded from a host copy of the pool (and of the table).
    pub fn decode_slot(
        &self,
        pool: &[u8],
        table: Option<&[i32]>,
        slot: usize,
        count: usize,
    ) -> Vec<f32> {
        let pb = self.rows.page_bytes();
        (0..count)
            .flat_map(|e| {
                let i = slot * self.pages_per_slot + e / KV_PAGE;
                let page = table.map_or(i, |t| t[i] as usize);
                self.rows.decode_row(&pool[page * pb..][..pb], e % KV_PAGE)
            })
            .collect()
    }
}

/// The block table of slots that own their pages: `table[s * pages_per_slot + i] = s *
/// pages_per_slot + i`.
pub fn static_block_table(num_slots: usize, pages_per_slot: usize) -> Vec<i32> {
    (0..(num_slots * pages_per_slot) as i32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Flash's rows: the sizes KERNELS.md §5 gives (576 + 8 B KV rows, 64 + 4 B keys).
    #[test]
    fn flash_rows_have_the_official_sizes() {
        let kv = KvRows::kv(KvFormat::Official, 512, 448);
        assert_eq!((kv.row_bytes(), kv.scale_bytes()), (576, 8));
        let ik = KvRows::index_keys(KvFormat::Official, 128);
        assert_eq!((ik.row_bytes(), ik.scale_bytes()), (64, 4));
        let f = KvRows::kv(KvFormat::F32, 512, 448);
        assert_eq!((f.row_bytes(), f.scale_bytes()), (2048, 0));
        for r in [kv, ik, f, KvRows::kv(KvFormat::Official, 72, 56)] {
            assert_eq!(r.page_bytes() % 256, 0, "{r:?}");
            assert_eq!(r.row_bytes() % KV_ROW_ALIGN, 0, "{r:?}");
        }
    }

    /// The host decoder reads the layout the module doc describes (hand-built page).
    #[test]
    fn decode_reads_codes_scales_and_bf16() {
        let kv = KvRows::kv(KvFormat::Official, 72, 64);
        let mut page = vec![0u8; kv.page_bytes()];
        let r = 3;
        let row = r * kv.row_bytes();
        page[row] = 0x38; // e4m3 1.0
        page[row + 63] = 0xb8; // -1.0
        page[row + 64..row + 66].copy_from_slice(&0x4040u16.to_le_bytes()); // bf16 3.0
        page[KV_PAGE * kv.row_bytes() + r * kv.scale_bytes()] = 129; // 2^2
        let v = kv.decode_row(&page, r);
        assert_eq!((v[0], v[63], v[64], v[1]), (4.0, -4.0, 3.0, 0.0));
        let ik = KvRows::index_keys(KvFormat::Official, 64);
        let mut page = vec![0u8; ik.page_bytes()];
        page[ik.row_bytes()] = 0x97; // row 1: nibble 7 (6.0), then 9 (-0.5)
        page[KV_PAGE * ik.row_bytes() + ik.scale_bytes() + 1] = 126; // block 1 of row 1: 2^-1
        page[ik.row_bytes() + 16] = 0x02; // channel 32 (block 1): 1.0
        let v = ik.decode_row(&page, 1);
        assert_eq!(
            (v[0], v[1], v[32]),
            (6.0 * e8m0_to_f32(0), -0.5 * e8m0_to_f32(0), 0.5)
        );
    }

    #[test]
    fn static_tables_map_slots_to_their_own_pages() {
        assert_eq!(static_block_table(2, 3), vec![0, 1, 2, 3, 4, 5]);
    }
}
