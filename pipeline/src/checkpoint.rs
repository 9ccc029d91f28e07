//! Distributed checkpoints: one directory, one shard file per layer written by the worker that
//! holds the layer, and a manifest written last.
//!
//! ```text
//! DIR/step-00000042/layer-0003.bin   postcard Shard: parameters and optimizer state
//! DIR/step-00000042/MANIFEST.json    every shard's size and CRC-32, the model, the driver's state
//! DIR/LATEST                          the step of the newest complete checkpoint
//! ```
//!
//! Every file is written to a temporary name, synced and renamed into place. The manifest is
//! renamed last, then `LATEST`: a checkpoint exists once its manifest does, so a crash in the
//! middle of a save (a worker killed while writing) leaves a step directory without a manifest
//! and the previous checkpoint valid. On restore every shard's size and checksum are checked
//! against the manifest, and a mismatch is an error naming the file and the check that failed.
//! Shards are per *layer*, so a checkpoint restores onto any partition and placement.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sluice_autograd::{DType, OptimizerKind, ParamState, Parameter, Tensor};

use crate::nn::Layer;

/// Bumped when the shard or manifest format changes.
pub const FORMAT: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {check} check failed: {detail}")]
    Corrupt {
        path: PathBuf,
        check: &'static str,
        detail: String,
    },
    #[error("no complete checkpoint in {0}")]
    None(PathBuf),
    #[error("{0} exists: a checkpoint of that step was already saved")]
    Exists(PathBuf),
    #[error("{0}")]
    Tensor(String),
}

type Result<T> = std::result::Result<T, CheckpointError>;

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_owned(),
        source,
    }
}

/// One saved tensor: its dtype and shape, and its elements (little-endian, row-major) as
/// `stored`: the dtype itself for f32, f64 and i64, f64 for the 16-bit floats (exact).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SavedTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub stored: DType,
    pub data: bytes::Bytes,
}

/// What one layer's shard holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Shard {
    pub format: u32,
    pub layer: usize,
    pub params: Vec<SavedTensor>,
    pub optimizer: Vec<(String, ParamState)>,
}

/// A shard as the manifest lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardEntry {
    pub layer: usize,
    pub file: String,
    pub bytes: u64,
    pub crc32: u32,
    /// The worker that wrote it.
    pub worker: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    pub step: u64,
    pub model: Vec<Layer>,
    pub seed: u64,
    /// The parameters' dtype and the update rule the saved optimizer state belongs to.
    pub dtype: DType,
    pub optimizer: OptimizerKind,
    pub shards: Vec<ShardEntry>,
    /// The driver's own state (data position, losses so far, ...).
    pub driver: serde_json::Value,
}

pub fn step_dir(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("step-{step:08}"))
}

/// Writes `bytes` to `path` through a temporary file, synced, then renamed into place.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = fs::File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(bytes).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    fs::rename(&tmp, path).map_err(io(path))?;
    Ok(())
}

fn sync_dir(dir: &Path) -> Result<()> {
    fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))
}

pub fn save_tensor(p: &Parameter) -> Result<SavedTensor> {
    let t = p.data();
    let fail = |e: sluice_autograd::Error| CheckpointError::Tensor(format!("{}: {e}", p.name()));
    // The elements' own bytes, without another copy (this crate only builds for
    // little-endian targets, where they are the stored form).
    let (stored, data) = match t.dtype() {
        DType::F32 => (
            DType::F32,
            bytes::Bytes::from_owner(Elements(t.to_vec::<f32>().map_err(fail)?)),
        ),
        DType::I64 => (
            DType::I64,
            bytes::Bytes::from_owner(Elements(t.to_vec::<i64>().map_err(fail)?)),
        ),
        _ => (
            DType::F64,
            bytes::Bytes::from_owner(Elements(t.to_f64_vec().map_err(fail)?)),
        ),
    };
    Ok(SavedTensor {
        name: p.name().to_owned(),
        dtype: t.dtype(),
        shape: t.shape().to_vec(),
        stored,
        data,
    })
}

/// A vector of plain numbers seen as its bytes.
struct Elements<T>(Vec<T>);

impl<T: bytemuck::Pod> AsRef<[u8]> for Elements<T> {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

#[cfg(not(target_endian = "little"))]
compile_error!("checkpoint shards store elements little-endian as they lie in memory");

pub fn load_tensor(s: &SavedTensor) -> Result<Tensor> {
    let mut strides = vec![1usize; s.shape.len()];
    for i in (0..s.shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * s.shape[i + 1].max(1);
    }
    // Checked against the bytes: a shape that reaches past them is an error, not a read.
    Tensor::from_bytes(s.data.clone(), s.stored, &s.shape, &strides, 0)
        .and_then(|t| t.to_dtype(s.dtype))
        .map_err(|e| CheckpointError::Tensor(format!("{}: {e}", s.name)))
}

/// Writes one layer's shard into `dir/step-N/` and returns its manifest entry.
pub fn write_shard(dir: &Path, step: u64, shard: &Shard, worker: &str) -> Result<ShardEntry> {
    let sd = step_dir(dir, step);
    fs::create_dir_all(&sd).map_err(io(&sd))?;
    let file = format!("layer-{:04}.bin", shard.layer);
    let bytes = postcard::to_allocvec(shard).map_err(|e| CheckpointError::Tensor(e.to_string()))?;
    write_atomic(&sd.join(&file), &bytes)?;
    Ok(ShardEntry {
        layer: shard.layer,
        file,
        bytes: bytes.len() as u64,
        crc32: crc32fast::hash(&bytes),
        worker: worker.to_owned(),
    })
}

/// Makes the checkpoint exist: the manifest, then `LATEST`; only once every shard it lists is
/// on disk here with the size the worker reported, one per layer.
pub fn commit(dir: &Path, manifest: &Manifest) -> Result<PathBuf> {
    let sd = step_dir(dir, manifest.step);
    let mut layers: Vec<usize> = manifest.shards.iter().map(|s| s.layer).collect();
    layers.sort_unstable();
    if layers != (0..manifest.model.len()).collect::<Vec<_>>() {
        return Err(CheckpointError::Corrupt {
            path: sd.clone(),
            check: "shards",
            detail: format!("layers {layers:?} for a model of {} layers", manifest.model.len()),
        });
    }
    for s in &manifest.shards {
        let path = sd.join(&s.file);
        let len = fs::metadata(&path).map_err(io(&path))?.len();
        if len != s.bytes {
            return Err(CheckpointError::Corrupt {
                path,
                check: "size",
                detail: format!("{len} bytes on disk, {} reported by {}", s.bytes, s.worker),
            });
        }
    }
    sync_dir(&sd)?;
    let json = serde_json::to_vec_pretty(manifest).map_err(|e| CheckpointError::Tensor(e.to_string()))?;
    let path = sd.join("MANIFEST.json");
    write_atomic(&path, &json)?;
    sync_dir(&sd)?;
    write_atomic(&dir.join("LATEST"), manifest.step.to_string().as_bytes())?;
    sync_dir(dir)?;
    Ok(path)
}

/// The manifest of step `step`, parsed and checked (format, one shard per layer).
pub fn manifest(dir: &Path, step: u64) -> Result<Manifest> {
    let path = step_dir(dir, step).join("MANIFEST.json");
    let bytes = fs::read(&path).map_err(io(&path))?;
    let corrupt = |check, detail: String| CheckpointError::Corrupt {
        path: path.clone(),
        check,
        detail,
    };
    let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| corrupt("parse", e.to_string()))?;
    if m.format != FORMAT {
        return Err(corrupt(
            "format",
            format!("format {} (this build reads {FORMAT})", m.format),
        ));
    }
    if m.step != step {
        return Err(corrupt(
            "step",
            format!("says step {} in the directory of step {step}", m.step),
        ));
    }
    let mut layers: Vec<usize> = m.shards.iter().map(|s| s.layer).collect();
    layers.sort_unstable();
    if layers != (0..m.model.len()).collect::<Vec<_>>() {
        return Err(corrupt(
            "shards",
            format!("layers {layers:?} for a model of {} layers", m.model.len()),
        ));
    }
    Ok(m)
}

/// The newest complete checkpoint: `LATEST`, else (if that is missing or broken) the highest
/// step directory with a manifest that parses.
pub fn latest(dir: &Path) -> Result<Manifest> {
    if let Ok(s) = fs::read_to_string(dir.join("LATEST")) {
        if let Ok(step) = s.trim().parse::<u64>() {
            if let Ok(m) = manifest(dir, step) {
                return Ok(m);
            }
        }
    }
    let mut steps: Vec<u64> = fs::read_dir(dir)
        .map_err(io(dir))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("step-")?.parse().ok())
        .collect();
    steps.sort_unstable();
    steps
        .into_iter()
        .rev()
        .find_map(|s| manifest(dir, s).ok())
        .ok_or_else(|| CheckpointError::None(dir.to_owned()))
}

/// Reads layer `layer`'s shard of `m`, checking its size and checksum against the manifest.
pub fn read_shard(dir: &Path, m: &Manifest, layer: usize) -> Result<Shard> {
    let entry = m
        .shards
        .iter()
        .find(|s| s.layer == layer)
        .ok_or_else(|| CheckpointError::None(dir.to_owned()))?;
    let path = step_dir(dir, m.step).join(&entry.file);
    let bytes = fs::read(&path).map_err(io(&path))?;
    let corrupt = |check, detail: String| CheckpointError::Corrupt {
        path: path.clone(),
        check,
        detail,
    };
    if bytes.len() as u64 != entry.bytes {
        return Err(corrupt(
            "size",
            format!("{} bytes, the manifest says {}", bytes.len(), entry.bytes),
        ));
    }
    let crc = crc32fast::hash(&bytes);
    if crc != entry.crc32 {
        return Err(corrupt(
            "crc32",
            format!("{crc:08x}, the manifest says {:08x}", entry.crc32),
        ));
    }
    let shard: Shard = postcard::from_bytes(&bytes).map_err(|e| corrupt("decode", e.to_string()))?;
    if shard.format != FORMAT || shard.layer != layer {
        return Err(corrupt(
            "layer",
            format!("format {} layer {}", shard.format, shard.layer),
        ));
    }
    Ok(shard)
}

/// Checks every shard of `m` (size, checksum, decoding) without loading it anywhere.
pub fn verify(dir: &Path, m: &Manifest) -> Result<()> {
    for s in &m.shards {
        read_shard(dir, m, s.layer)?;
    }
    Ok(())
}
