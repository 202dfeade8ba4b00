//! dsv4: a DeepSeek-V4 inference engine behind a C ABI.
//!
//! Data flows one way: `ffi` -> `engine` -> (`reference` | `cuda`) -> `backend` (the seam:
//! the trait both backends implement and the types they share), `options`, `model`, `state`,
//! `weights`. The C ABI lives only in `ffi`; everything below it speaks Rust types and
//! [`error::Error`].

pub mod backend;
pub mod config;
pub mod cuda;
pub mod engine;
pub mod error;
pub mod ffi;
pub mod load_report;
pub mod log;
pub mod memory;
pub mod model;
pub mod options;
pub mod reference;
mod refit_pairs;
pub mod state;
pub mod weights;

pub use config::ModelConfig;
pub use engine::{
    Batch, ConfigSource, Engine, EngineOptions, KernelSetName, LoadFormat, LogitsOut, Numerics,
    TensorUpdate, WeightFormat,
};
pub use error::{Error, Result, Status};
