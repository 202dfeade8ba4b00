//! GPU op tests of the `weight_convert` family (kernels/weight_convert.cu), which writes
//! weights from device memory (refit / load_tensors with DSV4_MEMORY_DEVICE). Every output is
//! compared BIT FOR BIT with the host path on the same values (src/weights/rows.rs
//! quantize_rows, half's BF16 rounding, src/weights/dtype.rs decoders). The values are built to
//! hit the rounding edges: exact ties of e4m3 / e2m1 / bf16, subnormal codes, ±0, saturating
//! values, block maxima exactly at and just past a power of two (the UE8M0 ceiling), blocks whose
//! amax falls below the scale floor, and ragged edge blocks. Outputs are poisoned first.
//!
//! Without a CUDA device every device test prints `skipped: no CUDA device` and returns. The
//! NVRTC compile check runs wherever NVRTC is installed (no GPU needed).

mod common;

use common::gpu::{assert_families_compile, family_gpu};
use common::rng::Rng;
use dsv4::cuda::kernels::weight_convert::{
    self, DestWeight, DeviceScale, SourceEnc, SourceRows, WeightConvert,
};
use dsv4::weights::dtype::{E4M3_LUT, ScaleDtype, dequant_fp8_rows};
use dsv4::weights::format::StorageFormat;
use dsv4::weights::qmatrix::QFormat;
use dsv4::weights::quant::{E2M1_MAX, E4M3_MAX};
use dsv4::weights::rows::quantize_rows;

type Dev = common::gpu::Dev<WeightConvert>;

fn dev() -> Option<Dev> {
    let g = family_gpu(&[&weight_convert::SOURCE])?;
    Some(Dev::new(g, WeightConvert::new(&g.reg).unwrap()))
}

#[test]
fn weight_convert_family_compiles_for_sm_90a() {
    assert_families_compile(&[&weight_convert::SOURCE]);
}

/// The non-negative finite e4m3 values, increasing.
fn e4m3_grid() -> Vec<f32> {
    (0u8..0x7f).map(|c| E4M3_LUT[c as usize]).collect()
}

/// A value on a rounding edge of `grid` (times `s`, random sign): a grid point, the exact
/// midpoint of two neighbours (a tie), or a hair either side of a midpoint.
fn edge_value(rng: &mut Rng, grid: &[f32], s: f32) -> f32 {
    let k = rng.below(grid.len() - 1);
    let (a, b) = (grid[k], grid[k + 1]);
    let mid = (a + b) / 2.0; // exact: neighbours differ by a power of two
    let v = match rng.below(4) {
        0 => a,
        1 => mid,
        2 => f32::from_bits(mid.to_bits() + 1),
        _ => f32::from_bits(mid.to_bits().saturating_sub(1)).max(0.0),
    };
    let v = v * s;
    if rng.below(2) == 0 { -v } else { v }
}

/// Rows x cols of edge values for `block` (FP8 [br, bc] or FP4 [1, 32]) blocks: each block
/// gets its own power-of-two scale and an amax element that sits exactly at `qmax * scale`,
/// just past it, or (for some blocks) far below the scale floor; plus ±0 and saturating values.
fn edge_matrix(
    rng: &mut Rng,
    rows: usize,
    cols: usize,
    block: [usize; 2],
    grid: &[f32],
    qmax: f32,
) -> Vec<f32> {
    let mut v = vec![0.0f32; rows * cols];
    for br in 0..rows.div_ceil(block[0]) {
        for bc in 0..cols.div_ceil(block[1]) {
            let kind = rng.below(8);
            let s = 2f32.powi(rng.below(40) as i32 - 30);
            let (r0, c0) = (br * block[0], bc * block[1]);
            let (r1, c1) = ((r0 + block[0]).min(rows), (c0 + block[1]).min(cols));
            for r in r0..r1 {
                for c in c0..c1 {
                    v[r * cols + c] = match rng.below(16) {
                        0 => 0.0,
                        1 => -0.0,
                        _ if kind == 0 => rng.uniform(-1.0, 1.0) * 1e-30, // below the floor
                        _ => edge_value(rng, grid, s),
                    };
                }
            }
            if kind != 0 {
                // The block's amax: exactly qmax * s, or one ulp past it (scale doubles).
                let a = qmax * s;
                let a = if kind == 1 {
                    f32::from_bits(a.to_bits() + 1)
                } else {
                    a
                };
                let (r, c) = (r0 + rng.below(r1 - r0), c0 + rng.below(c1 - c0));
                v[r * cols + c] = if rng.below(2) == 0 { -a } else { a };
                // And a saturating neighbour when the block has room.
                if r1 - r0 > 1 {
                    let r2 = if r + 1 < r1 { r + 1 } else { r - 1 };
                    v[r2 * cols + c] = a * 1.0000001;
                }
            }
        }
    }
    v
}

fn bytes_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bytes_bf16(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes())
        .collect()
}

/// The values a BF16 source holds (what the host decodes before quantizing).
fn via_bf16(v: &[f32]) -> Vec<f32> {
    v.iter()
        .map(|x| half::bf16::from_f32(*x).to_f32())
        .collect()
}

/// Runs `wc_convert_kernel` of `src`'s rows into a poisoned weight of `format` (`src.rows`
/// x `src.cols`); returns its value bytes and f32 scales (as bits).
fn convert_rows(
    d: &Dev,
    src: &SourceRows,
    format: StorageFormat,
    block: [usize; 2],
) -> (Vec<u8>, Vec<u32>) {
    let (rows, cols) = (src.rows, src.cols);
    let (db, ns) = (
        format.data_bytes(rows, cols),
        format.scale_count(rows, cols, block),
    );
    let (_a, p) = d.alloc(&[db, ns * 4]);
    d.poison(p[0]);
    d.poison(p[1]);
    let dst = DestWeight {
        data: p[0].slice(0, db).unwrap(),
        scales: format
            .is_quantized()
            .then(|| p[1].slice(0, ns * 4).unwrap()),
        format: Some(format),
        block,
    };
    {
        let _g = d.ctx().enter().unwrap();
        d.k.convert(src, &dst, d.s()).unwrap();
    }
    let data: Vec<u8> = d.get(p[0], db);
    let scales: Vec<u32> = if ns > 0 { d.get(p[1], ns) } else { vec![] };
    (data, scales)
}

/// [`convert_rows`] of a whole unscaled matrix of `enc` values, `bytes` copied to the device.
fn convert(
    d: &Dev,
    bytes: &[u8],
    enc: SourceEnc,
    [rows, cols]: [usize; 2],
    format: StorageFormat,
    block: [usize; 2],
) -> (Vec<u8>, Vec<u32>) {
    let (_a, p) = d.alloc(&[bytes.len()]);
    d.put(p[0], bytes);
    let rows_src = SourceRows {
        ptr: p[0].slice(0, bytes.len()).unwrap(),
        enc,
        scale: None,
        mat_rows: rows,
        cols,
        row0: 0,
        rows,
    };
    convert_rows(d, &rows_src, format, block)
}

/// The host's codes and scales of `vals` quantized to `q` (rows.rs quantize_rows).
fn host_quantized(
    q: QFormat,
    vals: &[f32],
    cols: usize,
    format: StorageFormat,
    rows: usize,
    block: [usize; 2],
) -> (Vec<u8>, Vec<u32>) {
    let mut codes = vec![0u8; format.data_bytes(rows, cols)];
    let mut scales = vec![0f32; format.scale_count(rows, cols, block)];
    quantize_rows(q, vals, cols, &mut codes, &mut scales);
    (codes, scales.iter().map(|s| s.to_bits()).collect())
}

/// FP8 block quantization of F32 and BF16 sources on the device equals the host quantizer,
/// codes and scales, on rounding-edge values with ragged 128x128 blocks.
#[test]
fn fp8_quantization_equals_the_host_on_edge_values() {
    let Some(d) = dev() else { return };
    let mut rng = Rng::from_env("fp8_quantization_equals_the_host_on_edge_values");
    let (rows, cols, block) = (300, 200, [128, 128]);
    let vals = edge_matrix(&mut rng, rows, cols, block, &e4m3_grid(), E4M3_MAX);
    let q = QFormat::Fp8 { block };
    for (enc, bytes, host_vals) in [
        (SourceEnc::F32, bytes_f32(&vals), vals.clone()),
        (SourceEnc::Bf16, bytes_bf16(&vals), via_bf16(&vals)),
    ] {
        let got = convert(&d, &bytes, enc, [rows, cols], StorageFormat::Fp8, block);
        let want = host_quantized(q, &host_vals, cols, StorageFormat::Fp8, rows, block);
        assert_eq!(got.1, want.1, "{enc:?}: scales");
        let bad = got.0.iter().zip(&want.0).position(|(a, b)| a != b);
        assert!(
            bad.is_none(),
            "{enc:?}: code {bad:?} of {} (value {})",
            got.0.len(),
            host_vals[bad.unwrap()]
        );
    }
}

/// FP4 (1x32) quantization of F32 sources equals the host's, nibbles and scales, on the e2m1
/// ties (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 times the scale) and the other edges.
#[test]
fn fp4_quantization_equals_the_host_on_edge_values() {
    let Some(d) = dev() else { return };
    let mut rng = Rng::from_env("fp4_quantization_equals_the_host_on_edge_values");
    let (rows, cols) = (37, 96 + 32 + 6);
    let grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let vals = edge_matrix(&mut rng, rows, cols, [1, 32], &grid, E2M1_MAX);
    let bytes = bytes_f32(&vals);
    let got = convert(
        &d,
        &bytes,
        SourceEnc::F32,
        [rows, cols],
        StorageFormat::Fp4,
        [1, 32],
    );
    let want = host_quantized(QFormat::Fp4, &vals, cols, StorageFormat::Fp4, rows, [1, 32]);
    assert_eq!(got.1, want.1, "scales");
    assert_eq!(got.0, want.0, "packed nibbles");
}

/// F32 -> BF16 storage rounds to nearest even like `half` (ties included); FP8 codes with
/// UE8M0 scales decode like dtype.rs and requantize to FP4 like the host; I64 -> I32 narrows.
#[test]
fn conversions_equal_the_host() {
    let Some(d) = dev() else { return };
    let mut rng = Rng::from_env("conversions_equal_the_host");
    // BF16: values on bf16 ties (low 16 bits exactly 0x8000) and near them.
    let vals: Vec<f32> = (0..4096)
        .map(|_| {
            let hi = (rng.below(1 << 16) as u32) << 16;
            let lo = [0x8000, 0x7fff, 0x8001, 0][rng.below(4)];
            let v = f32::from_bits(hi | lo);
            if v.is_finite() { v } else { 1.5 }
        })
        .collect();
    let bytes = bytes_f32(&vals);
    let got = convert(
        &d,
        &bytes,
        SourceEnc::F32,
        [64, 64],
        StorageFormat::Bf16,
        [0, 0],
    );
    assert_eq!(got.0, bytes_bf16(&vals), "f32 -> bf16");

    // FP8 codes (no NaN) with UE8M0 scales of a 2-matrix stack [2 x 160, 96], matrix 1 into FP4.
    let (mat, cols, block) = (160usize, 96usize, [128usize, 128usize]);
    let codes: Vec<u8> = (0..2 * mat * cols)
        .map(|_| {
            let b = rng.below(256) as u8;
            if b & 0x7f == 0x7f { b - 1 } else { b }
        })
        .collect();
    let per_mat = mat.div_ceil(block[0]) * cols.div_ceil(block[1]);
    let e8: Vec<u8> = (0..2 * per_mat)
        .map(|_| 110 + rng.below(30) as u8)
        .collect();
    let (_b, q) = d.alloc(&[codes.len(), e8.len()]);
    d.put(q[0], &codes);
    d.put(q[1], &e8);
    let scale = DeviceScale {
        ptr: q[1].slice(0, e8.len()).unwrap(),
        f32: false,
        block,
    };
    let src = SourceRows {
        ptr: q[0].slice(0, codes.len()).unwrap(),
        enc: SourceEnc::Fp8,
        scale: Some(scale),
        mat_rows: mat,
        cols,
        row0: mat,
        rows: mat,
    };
    let f = StorageFormat::Fp4;
    let got = convert_rows(&d, &src, f, [1, 32]);
    let mut decoded = vec![0f32; mat * cols];
    dequant_fp8_rows(
        &codes[mat * cols..],
        &e8[per_mat..],
        ScaleDtype::E8M0,
        0,
        cols,
        block,
        &mut decoded,
    );
    let want = host_quantized(QFormat::Fp4, &decoded, cols, f, mat, [1, 32]);
    assert_eq!(got.1, want.1, "fp8 -> fp4 scales");
    assert_eq!(got.0, want.0, "fp8 -> fp4 codes");

    // I64 ids -> I32 storage.
    let ids: Vec<i64> = (0..600).map(|_| rng.below(256) as i64).collect();
    let (_e, r) = d.alloc(&[ids.len() * 8, ids.len() * 4]);
    d.put(r[0], &ids);
    d.poison(r[1]);
    let src = SourceRows {
        ptr: r[0].slice(0, ids.len() * 8).unwrap(),
        enc: SourceEnc::I64,
        scale: None,
        mat_rows: 100,
        cols: 6,
        row0: 0,
        rows: 100,
    };
    let dst = DestWeight {
        data: r[1].slice(0, ids.len() * 4).unwrap(),
        scales: None,
        format: None,
        block: [0, 0],
    };
    {
        let _g = d.ctx().enter().unwrap();
        d.k.convert(&src, &dst, d.s()).unwrap();
    }
    let want: Vec<i32> = ids.iter().map(|&v| v as i32).collect();
    assert_eq!(d.get::<i32>(r[1], ids.len()), want, "i64 -> i32");
}

/// The check pass reports the FIRST bad element: a non-finite F32 / BF16 / F16 value, an
/// I32 / I64 id outside [0, bound); u64::MAX when all pass.
#[test]
fn the_scan_finds_the_first_bad_element() {
    let Some(d) = dev() else { return };
    let n = 5000usize;
    let (_a, p) = d.alloc(&[n * 8, 8]);
    let first = p[1].slice(0, 8).unwrap();
    let scan = |bytes: &[u8], enc: SourceEnc, bound: usize| -> u64 {
        d.put(p[0], bytes);
        let src = p[0].slice(0, bytes.len()).unwrap();
        {
            let _g = d.ctx().enter().unwrap();
            d.k.scan(src, enc, n, bound, first, d.s()).unwrap();
        }
        d.get::<u64>(first, 1)[0]
    };
    let mut f: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 100.0).collect();
    assert_eq!(
        scan(&bytes_f32(&f), SourceEnc::F32, 0),
        u64::MAX,
        "all finite"
    );
    f[4321] = f32::INFINITY;
    f[1234] = f32::NAN;
    assert_eq!(scan(&bytes_f32(&f), SourceEnc::F32, 0), 1234);
    assert_eq!(scan(&bytes_bf16(&f), SourceEnc::Bf16, 0), 1234);
    let h: Vec<u8> = f
        .iter()
        .flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes())
        .collect();
    assert_eq!(scan(&h, SourceEnc::F16, 0), 1234);
    let mut ids: Vec<i64> = (0..n as i64).map(|i| i % 256).collect();
    assert_eq!(
        scan(
            &ids.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>(),
            SourceEnc::I64,
            256
        ),
        u64::MAX
    );
    ids[77] = 256;
    ids[3000] = -1;
    let i64s: Vec<u8> = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(scan(&i64s, SourceEnc::I64, 256), 77);
    let i32s: Vec<u8> = ids.iter().flat_map(|v| (*v as i32).to_le_bytes()).collect();
    assert_eq!(scan(&i32s, SourceEnc::I32, 256), 77);
}
