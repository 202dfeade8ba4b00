//! A synthetic MoE layer in device memory, drawn like real weights, for the fast MoE's op tests
//! (tests/gpu_fast_moe.rs) and `dsv4 bench moe`: FP4 routed experts (codes uniform, per-32 scales
//! 2^-9 .. 2^-5), an FP8 shared expert (codes from values spread over the e4m3 range, 128x128
//! scales 2^-12 .. 2^-9), a BF16-valued gate, an f32 bias, and two hash tables: uniform rows, and
//! rows that put one "hot" expert first in 30% of them (skewed routing).
//!
//! Each projection's experts are contiguous; the pointer tables are built like the engine's
//! (one u64 per expert), so the kernels see exactly the engine's operand layout.

use crate::config::ScoringFunc;
use crate::cuda::arena::{self, Arena, ArenaPlan, DevicePtr};
use crate::cuda::kernels::fast_moe::{self, FastExperts, FastMoe, FastMoeLayer, FastShared};
use crate::cuda::kernels::fast_moe_gemm::{self, ExpertMatrices};
use crate::cuda::kernels::linear::WeightDev;
use crate::cuda::kernels::moe::{ExpertsDev, RouterParams, Selection};
use crate::cuda::{BorrowedStream, Context};
use crate::error::Result;
use crate::weights::format::StorageFormat;
use crate::weights::quant::e4m3_encode;

/// Shapes of the layer.
#[derive(Clone, Copy, Debug)]
pub struct MoeShape {
    pub d: usize,
    pub i: usize,
    pub experts: usize,
    pub k: usize,
    /// Rows of the hash tables (token ids are drawn below this).
    pub vocab: usize,
    pub limit: f32,
}

impl MoeShape {
    /// DeepSeek-V4-Flash: hidden 4096, moe_inter 2048, 256 experts top-6, swiglu_limit 10.
    pub const FLASH: MoeShape = MoeShape {
        d: 4096,
        i: 2048,
        experts: 256,
        k: 6,
        vocab: 4096,
        limit: 10.0,
    };

    /// Bytes of one routed expert in the checkpoint's format (FP4 codes + UE8M0 per 32).
    pub fn routed_expert_bytes(&self) -> usize {
        3 * (self.d * self.i / 2 + self.d * self.i / 32)
    }

    /// Bytes of the shared expert in the checkpoint's format (FP8 codes + UE8M0 per 128x128).
    pub fn shared_expert_bytes(&self) -> usize {
        3 * (self.d * self.i + (self.d / 128) * (self.i / 128))
    }
}

/// The expert the skewed table puts in 30% of its rows.
pub const HOT_EXPERT: usize = 7;

/// How a batch is routed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routing {
    /// sqrtsoftplus + bias top-k.
    TopK,
    /// Hash table, uniform rows.
    Hash,
    /// Hash table, HOT_EXPERT in 30% of the rows.
    HashSkewed,
}

/// xorshift64*: deterministic per seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    pub fn u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in [lo, hi), 24 random bits.
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.u64() >> 40) as f32 / (1u64 << 24) as f32)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.u64() % n as u64) as usize
    }
}

fn bf16(v: f32) -> f32 {
    half::bf16::from_f32(v).to_f32()
}

/// The layer's device buffers and the host copies the tests check against.
pub struct SyntheticMoe {
    pub shape: MoeShape,
    _arena: Arena,
    pub gate: DevicePtr,
    pub bias: DevicePtr,
    pub tid2eid: DevicePtr,
    pub tid2eid_skewed: DevicePtr,
    pub gate_host: Vec<f32>,
    pub bias_host: Vec<f32>,
    pub tid2eid_host: Vec<i32>,
    pub tid2eid_skewed_host: Vec<i32>,
    /// w1, w2, w3 of the routed experts, as the reference kernels take them.
    pub routed: [ExpertsDev; 3],
    /// w1, w2, w3 of the shared expert.
    pub shared: [WeightDev; 3],
    /// The fast GEMMs' tensor map table (routed experts, then the shared expert).
    pub maps: DevicePtr,
    /// The matrices' addresses the table describes.
    matrices: Vec<ExpertMatrices>,
    /// The fast GEMMs' UE8M0 scale table: built by [`SyntheticMoe::derive_fast`].
    pub scales8: DevicePtr,
    /// The tensor-core router's gate planes: built by [`SyntheticMoe::derive_fast`].
    pub gate_planes: DevicePtr,
}

fn hash_table(rng: &mut Rng, sh: &MoeShape, skewed: bool) -> Vec<i32> {
    let mut t = Vec::with_capacity(sh.vocab * sh.k);
    for v in 0..sh.vocab {
        let mut row: Vec<i32> = Vec::with_capacity(sh.k);
        if skewed && v % 10 < 3 {
            row.push(HOT_EXPERT as i32);
        }
        while row.len() < sh.k {
            let e = rng.below(sh.experts) as i32;
            if !row.contains(&e) {
                row.push(e);
            }
        }
        t.extend(row);
    }
    t
}

impl SyntheticMoe {
    /// Draws and uploads the layer (synchronously, on `s`).
    pub fn new(
        ctx: &Context,
        s: BorrowedStream,
        shape: MoeShape,
        seed: u64,
    ) -> Result<SyntheticMoe> {
        let sh = shape;
        let (d, i, e, k) = (sh.d, sh.i, sh.experts, sh.k);
        let mut rng = Rng::new(seed);
        // (rows, cols) of w1, w2, w3.
        let shapes = [(i, d), (d, i), (i, d)];
        let mut sizes = vec![e * d * 4, e * 4, sh.vocab * k * 4, sh.vocab * k * 4];
        for &(r, c) in &shapes {
            sizes.extend([e * r * c / 2, e * r * (c / 32) * 4, e * 8, e * 8]);
        }
        for &(r, c) in &shapes {
            sizes.extend([r * c, r.div_ceil(128) * c.div_ceil(128) * 4]);
        }
        // The fast GEMMs' tensor map table and UE8M0 scale table: the routed experts, then the
        // shared expert.
        sizes.push((e + 1) * fast_moe_gemm::MAPS_PER_EXPERT * fast_moe_gemm::MAP_BYTES);
        sizes.push(fast_moe_gemm::scales8_bytes(d, i, e + 1));
        sizes.push(fast_moe::gate_planes_bytes(e, d));
        let mut plan = ArenaPlan::new();
        let ids: Vec<_> = sizes
            .iter()
            .enumerate()
            .map(|(n, &b)| plan.reserve(format!("synthetic_moe.{n}"), b.max(4), 256))
            .collect::<Result<_>>()?;
        let arena = Arena::from_plan(ctx, &plan)?;
        let p: Vec<DevicePtr> = ids.iter().map(|&n| arena.region(n)).collect();
        let _g = ctx.enter()?;
        let gate_host: Vec<f32> = (0..e * d).map(|_| bf16(rng.uniform(-0.05, 0.05))).collect();
        let bias_host: Vec<f32> = (0..e).map(|_| rng.uniform(-0.1, 0.1)).collect();
        let tid2eid_host = hash_table(&mut rng, &sh, false);
        let tid2eid_skewed_host = hash_table(&mut rng, &sh, true);
        arena::copy_to_device_sync(p[0], &gate_host, s)?;
        arena::copy_to_device_sync(p[1], &bias_host, s)?;
        arena::copy_to_device_sync(p[2], &tid2eid_host, s)?;
        arena::copy_to_device_sync(p[3], &tid2eid_skewed_host, s)?;
        let mut routed = Vec::new();
        // Per matrix (w1, w2, w3): each expert's code and scale addresses.
        let mut addrs: Vec<Vec<(u64, u64)>> = Vec::new();
        for (j, &(r, c)) in shapes.iter().enumerate() {
            let [data, scales, tdata, tscales] = [0, 1, 2, 3].map(|q| p[4 + 4 * j + q]);
            let (nbytes, nscales) = (r * c / 2, r * (c / 32));
            let mut codes = vec![0u8; nbytes];
            let mut sc = vec![0f32; nscales];
            for ex in 0..e {
                for ch in codes.chunks_mut(8) {
                    let v = rng.u64().to_le_bytes();
                    ch.copy_from_slice(&v[..ch.len()]);
                }
                for v in sc.iter_mut() {
                    *v = (-9.0 + rng.below(5) as f32).exp2();
                }
                arena::copy_to_device_sync(data.slice(ex * nbytes, nbytes)?, &codes, s)?;
                arena::copy_to_device_sync(scales.slice(ex * nscales * 4, nscales * 4)?, &sc, s)?;
            }
            let ptrs: Vec<u64> = (0..e).map(|x| data.addr() + (x * nbytes) as u64).collect();
            let sptrs: Vec<u64> = (0..e)
                .map(|x| scales.addr() + (x * nscales * 4) as u64)
                .collect();
            arena::copy_to_device_sync(tdata, &ptrs, s)?;
            arena::copy_to_device_sync(tscales, &sptrs, s)?;
            addrs.push(ptrs.iter().copied().zip(sptrs.iter().copied()).collect());
            routed.push(ExpertsDev {
                format: StorageFormat::Fp4,
                ptrs: tdata,
                scales: Some(tscales),
                block: [0, 0],
                rows: r,
                cols: c,
                count: e,
            });
        }
        let mut shared = Vec::new();
        for (j, &(r, c)) in shapes.iter().enumerate() {
            let (data, scales) = (p[16 + 2 * j], p[17 + 2 * j]);
            let codes: Vec<u8> = (0..r * c)
                .map(|_| e4m3_encode(rng.uniform(-1.0, 1.0) * rng.uniform(0.0, 1.0) * 400.0))
                .collect();
            let sc: Vec<f32> = (0..r.div_ceil(128) * c.div_ceil(128))
                .map(|_| (-12.0 + rng.below(4) as f32).exp2())
                .collect();
            arena::copy_to_device_sync(data, &codes, s)?;
            arena::copy_to_device_sync(scales, &sc, s)?;
            shared.push(WeightDev {
                format: StorageFormat::Fp8,
                data: data.slice(0, r * c)?,
                scales: Some(scales.slice(0, sc.len() * 4)?),
                block: [128, 128],
                rows: r,
                cols: c,
            });
        }
        let mut matrices: Vec<ExpertMatrices> = (0..e)
            .map(|x| ExpertMatrices {
                format: StorageFormat::Fp4,
                w1: addrs[0][x].0,
                w2: addrs[1][x].0,
                w3: addrs[2][x].0,
                s1: addrs[0][x].1,
                s2: addrs[1][x].1,
                s3: addrs[2][x].1,
            })
            .collect();
        matrices.push(ExpertMatrices {
            format: StorageFormat::Fp8,
            w1: shared[0].data.addr(),
            w2: shared[1].data.addr(),
            w3: shared[2].data.addr(),
            ..ExpertMatrices::NONE
        });
        let maps = p[22];
        arena::copy_to_device_sync(maps, &fast_moe_gemm::tensor_maps(d, i, &matrices)?, s)?;
        s.synchronize()?;
        Ok(SyntheticMoe {
            maps,
            matrices,
            scales8: p[23],
            gate_planes: p[24],
            shape: sh,
            gate: p[0],
            bias: p[1],
            tid2eid: p[2],
            tid2eid_skewed: p[3],
            gate_host,
            bias_host,
            tid2eid_host,
            tid2eid_skewed_host,
            routed: [routed[0], routed[1], routed[2]],
            shared: [shared[0], shared[1], shared[2]],
            _arena: arena,
        })
    }

    /// Rewrites the tensor map table as the bench probe FMOE_PROBE_FLAT reads it
    /// ([`fast_moe_gemm::probe_flat_tensor_maps`]: timings only, the outputs are not the layer's).
    pub fn write_probe_flat_maps(&self, s: BorrowedStream) -> Result<()> {
        let (d, i) = (self.shape.d, self.shape.i);
        let table = fast_moe_gemm::probe_flat_tensor_maps(d, i, &self.matrices)?;
        arena::copy_to_device_sync(self.maps, &table, s)
    }

    /// The router: sqrtsoftplus, renormalised, routed scale 1.5 (V4-Flash).
    pub fn router(&self) -> RouterParams {
        RouterParams {
            experts: self.shape.experts,
            k: self.shape.k,
            scoring: ScoringFunc::SqrtSoftplus,
            renorm: true,
            route_scale: 1.5,
        }
    }

    /// How `routing` selects, for token ids at `tokens` (hash layers).
    pub fn selection(&self, routing: Routing, tokens: DevicePtr) -> Selection {
        match routing {
            Routing::TopK => Selection::TopK {
                bias: Some(self.bias),
            },
            Routing::Hash | Routing::HashSkewed => Selection::Hash {
                tid2eid: if routing == Routing::Hash {
                    self.tid2eid
                } else {
                    self.tid2eid_skewed
                },
                tokens,
                vocab: self.shape.vocab,
            },
        }
    }

    /// The expert ids a hash routing gives token `tok` (host side).
    pub fn hash_row(&self, routing: Routing, tok: usize) -> &[i32] {
        let t = match routing {
            Routing::HashSkewed => &self.tid2eid_skewed_host,
            _ => &self.tid2eid_host,
        };
        &t[tok * self.shape.k..(tok + 1) * self.shape.k]
    }

    /// Builds the layer's derived tensors that need a kernel (as finalize does for an engine):
    /// call once before running the fast layer.
    pub fn derive_fast(&self, ctx: &Context, fast: &FastMoe, s: BorrowedStream) -> Result<()> {
        fast.derive(ctx, &self.fast_layer(Routing::TopK, self.tid2eid), s)?;
        s.synchronize()
    }

    /// The layer as the fast kernels take it.
    pub fn fast_layer(&self, routing: Routing, tokens: DevicePtr) -> FastMoeLayer {
        let sh = &self.shape;
        let fe = |x: &ExpertsDev| FastExperts {
            format: x.format,
            scales: x.scales.expect("FP4 experts have scales"),
        };
        FastMoeLayer {
            d: sh.d,
            i: sh.i,
            k: sh.k,
            experts: sh.experts,
            local: 0..sh.experts,
            gate: self.gate,
            gate_planes: self.gate_planes,
            selection: self.selection(routing, tokens),
            router: self.router(),
            w1: fe(&self.routed[0]),
            w3: fe(&self.routed[2]),
            w2: fe(&self.routed[1]),
            shared: Some(FastShared {
                w1: self.shared[0],
                w3: self.shared[2],
                w2: self.shared[1],
            }),
            maps: self.maps,
            scales8: Some(self.scales8),
            limit: sh.limit,
        }
    }
}
