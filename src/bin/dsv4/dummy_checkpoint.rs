//! `dsv4 dummy-checkpoint --config FILE --out DIR [--seed S]`: writes the dummy weights of a
//! config as a safetensors checkpoint in the upstream format, so that checkpoint loads can be
//! measured at real shapes without a download (scripts/write-dummy-checkpoint.sh).
//!
//! The values are those `dsv4_load` with format DUMMY gives (seed 0x5EED_D5F4 by default), in
//! the release's encodings: FP8 weights as F8_E4M3 codes with an F8_E8M0 `.scale` (128x128
//! blocks), FP4 experts as packed I8 codes with an F8_E8M0 `.scale` (1x32), other floats as
//! BF16 (the dummy values are BF16-exact), hash tables as I32. So a load of the checkpoint
//! holds exactly the bytes of a dummy load. One file for the global tensors, then one per
//! layer, each made in memory (a layer at a time) and written out.

use std::path::{Path, PathBuf};

use dsv4::ModelConfig;
use dsv4::weights::WeightFormat;
use dsv4::weights::dummy::DummyValues;
use dsv4::weights::qmatrix::QFormat;
use dsv4::weights::rows::Geometry;
use dsv4::weights::table::{StorageKind, TableEntry, WeightTable};
use dsv4::weights::values::WeightValues;
use safetensors::Dtype;
use safetensors::tensor::TensorView;

use crate::{Args, err};

/// The seed `dsv4_load` uses for DUMMY.
const DUMMY_SEED: u64 = 0x5EED_D5F4;

/// One checkpoint tensor: name, dtype, shape, bytes.
type Out = (String, Dtype, Vec<usize>, Vec<u8>);

pub fn run(a: &Args) -> Result<(), String> {
    let config = a
        .get("config")
        .ok_or("dummy-checkpoint needs --config FILE")?;
    let out = PathBuf::from(a.get("out").ok_or("dummy-checkpoint needs --out DIR")?);
    let seed = match a.get("seed") {
        Some(s) => s
            .parse()
            .map_err(|_| format!("--seed must be a number, got `{s}`"))?,
        None => DUMMY_SEED,
    };
    let cfg = ModelConfig::from_path(Path::new(config)).map_err(err)?;
    let table = WeightTable::new(&cfg, WeightFormat::AsStored).map_err(err)?;
    let values = DummyValues::new(&table, &cfg, seed);
    std::fs::create_dir_all(&out).map_err(|e| format!("cannot create `{}`: {e}", out.display()))?;
    std::fs::copy(config, out.join("config.json"))
        .map_err(|e| format!("cannot copy the config into `{}`: {e}", out.display()))?;
    // Group the weights by file: globals (no `layers.` prefix) first, then layer by layer.
    let layer_of = |e: &TableEntry| -> Option<usize> {
        e.spec
            .name
            .strip_prefix("layers.")?
            .split('.')
            .next()?
            .parse()
            .ok()
    };
    let files = cfg.num_layers + 1;
    for f in 0..files {
        let members: Vec<usize> = (0..table.len())
            .filter(|&i| match layer_of(table.entry(i)) {
                None => f == 0,
                Some(l) => l + 1 == f,
            })
            .collect();
        let tensors: Vec<Out> = members
            .iter()
            .flat_map(|&i| encode(&table, &values, i))
            .collect();
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .map(|(n, d, s, b)| {
                TensorView::new(*d, s.clone(), b)
                    .map(|v| (n.clone(), v))
                    .map_err(|e| format!("tensor `{n}`: {e}"))
            })
            .collect::<Result<_, _>>()?;
        let path = out.join(format!("model-{:05}-of-{files:05}.safetensors", f + 1));
        safetensors::serialize_to_file(views, None, &path)
            .map_err(|e| format!("cannot write `{}`: {e}", path.display()))?;
        eprintln!("wrote {} ({} tensors)", path.display(), tensors.len());
    }
    Ok(())
}

/// The upstream name of weight `name`'s block scale (`x.weight` -> `x.scale`).
pub fn scale_name(name: &str) -> String {
    name.strip_suffix(".weight")
        .map_or_else(|| format!("{name}.scale"), |b| format!("{b}.scale"))
}

/// The UE8M0 bytes (biased exponents) of power-of-two scales.
pub fn e8m0(scales: &[f32]) -> Vec<u8> {
    scales
        .iter()
        .map(|v| ((v.to_bits() >> 23) & 0xff) as u8)
        .collect()
}

/// Weight `i` in the release's encoding: the tensor, and for quantized storage its scale.
fn encode(table: &WeightTable, values: &DummyValues, i: usize) -> Vec<Out> {
    let e = table.entry(i);
    let g = Geometry::of(e);
    let rows = 0..g.rows;
    let mut data = vec![0u8; g.data_range(&rows).len()];
    let mut scales = vec![0f32; g.scale_range(&rows).len()];
    values.fill(table, i, rows, &mut data, &mut scales);
    let name = e.spec.name.clone();
    let shape = e.spec.shape.clone();
    let scale_name = scale_name(&name);
    match g.kind {
        StorageKind::F32 => {
            let bf: Vec<u8> = data
                .chunks_exact(4)
                .flat_map(|b| {
                    let v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    half::bf16::from_f32(v).to_bits().to_le_bytes()
                })
                .collect();
            vec![(name, Dtype::BF16, shape, bf)]
        }
        StorageKind::Bf16 => vec![(name, Dtype::BF16, shape, data)],
        StorageKind::I32 => vec![(name, Dtype::I32, shape, data)],
        StorageKind::Quant(QFormat::Fp8 { block }) => {
            let grid = vec![g.rows.div_ceil(block[0]), g.cols.div_ceil(block[1])];
            vec![
                (name, Dtype::F8_E4M3, shape, data),
                (scale_name, Dtype::F8_E8M0, grid, e8m0(&scales)),
            ]
        }
        StorageKind::Quant(QFormat::Fp4) => {
            let grid = vec![g.rows, g.cols.div_ceil(32)];
            vec![
                (name, Dtype::I8, vec![g.rows, g.cols / 2], data),
                (scale_name, Dtype::F8_E8M0, grid, e8m0(&scales)),
            ]
        }
    }
}
