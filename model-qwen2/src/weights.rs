//! Reading the tensors of a Hugging Face checkpoint folder: `model.safetensors`, or shards listed
//! in `model.safetensors.index.json`. Files are memory-mapped; each tensor is copied out once,
//! converted to the compute dtype and uploaded, so the host never holds a second copy of the
//! whole model.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use burn::tensor::{DType, Device, Tensor, TensorData};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors, tensor::Metadata};
use serde::Deserialize;

use crate::error::{ModelError, Result};

struct Shard {
    path: PathBuf,
    mmap: Mmap,
    data_start: usize,
    metadata: Metadata,
}

/// The tensors of a checkpoint folder, read on demand and tracked, so that tensors the model
/// never asked for are reported by [`Checkpoint::finish`].
pub struct Checkpoint {
    shards: Vec<Shard>,
    /// Tensor name → shard index.
    index: BTreeMap<String, usize>,
    used: BTreeSet<String>,
}

/// Bytes of one tensor as stored, with its dtype and shape.
pub struct RawTensor {
    /// Little-endian element bytes.
    pub bytes: Vec<u8>,
    /// Element type on disk.
    pub dtype: DType,
    /// Shape on disk.
    pub shape: Vec<usize>,
}

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: HashMap<String, String>,
}

impl Checkpoint {
    /// Opens `model.safetensors`, or the shards named by `model.safetensors.index.json`.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if single.exists() {
            vec![single]
        } else if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|source| ModelError::Io {
                path: index_path.clone(),
                source,
            })?;
            let index: ShardIndex = serde_json::from_str(&text).map_err(|e| ModelError::Parse {
                path: index_path.clone(),
                message: e.to_string(),
            })?;
            let names: BTreeSet<String> = index.weight_map.into_values().collect();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else {
            return Err(ModelError::MissingFile(single));
        };
        let mut shards = Vec::with_capacity(files.len());
        let mut index = BTreeMap::new();
        for path in files {
            let shard = Shard::open(path)?;
            for name in shard.metadata.offset_keys() {
                index.insert(name, shards.len());
            }
            shards.push(shard);
        }
        Ok(Self {
            shards,
            index,
            used: BTreeSet::new(),
        })
    }

    /// True if the checkpoint stores `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// The one value of scalar tensor `name` (shape `[]` or `[1]`, any float dtype) as f32, or
    /// `None` when the checkpoint has no such tensor.
    pub fn scalar(&mut self, name: &str) -> Result<Option<f32>> {
        let Some(&shard) = self.index.get(name) else {
            return Ok(None);
        };
        let shape = self.shards[shard]
            .metadata
            .info(name)
            .expect("indexed tensor has metadata")
            .shape
            .clone();
        if shape.iter().product::<usize>() != 1 || shape.len() > 1 {
            return Err(ModelError::ShapeMismatch {
                name: name.to_string(),
                actual: shape,
                expected: vec![],
            });
        }
        let raw = self.raw(name, &shape)?;
        let values = TensorData::from_bytes_vec(raw.bytes, [1], raw.dtype)
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| ModelError::Input(format!("{name}: {e:?}")))?;
        Ok(values.first().copied())
    }

    /// The raw bytes of `name`, checked against `expected` shape.
    pub fn raw(&mut self, name: &str, expected: &[usize]) -> Result<RawTensor> {
        let &shard = self
            .index
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        let shard = &self.shards[shard];
        let info = shard
            .metadata
            .info(name)
            .expect("indexed tensor has metadata");
        if info.shape != expected {
            return Err(ModelError::ShapeMismatch {
                name: name.to_string(),
                actual: info.shape.clone(),
                expected: expected.to_vec(),
            });
        }
        let dtype = match info.dtype {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            other => {
                return Err(ModelError::UnsupportedDtype {
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                });
            }
        };
        let (start, end) = info.data_offsets;
        let bytes = shard.mmap[shard.data_start + start..shard.data_start + end].to_vec();
        self.used.insert(name.to_string());
        Ok(RawTensor {
            bytes,
            dtype,
            shape: info.shape.clone(),
        })
    }

    /// Tensor `name`, checked against its whole `shape`, then the part `range` of dimension
    /// `dim` (a tensor-parallel rank's share), converted to `dtype` on `device`.
    pub fn tensor_part<const D: usize>(
        &mut self,
        name: &str,
        shape: [usize; D],
        (dim, range): (usize, std::ops::Range<usize>),
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor<D>> {
        let raw = self.raw(name, &shape)?.slice(dim, range);
        Ok(raw.into_tensor(dtype, device))
    }

    /// Tensor `name`, checked against `shape`, converted to `dtype` on `device`.
    pub fn tensor<const D: usize>(
        &mut self,
        name: &str,
        shape: [usize; D],
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor<D>> {
        let raw = self.raw(name, &shape)?;
        Ok(raw.into_tensor(dtype, device))
    }

    /// Several tensors of equal trailing shape concatenated along dim 0 (e.g. q, k and v into
    /// one projection), converted to `dtype` on `device`.
    pub fn concat<const D: usize>(
        &mut self,
        parts: &[(&str, [usize; D])],
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor<D>> {
        let whole: Vec<_> = parts
            .iter()
            .map(|&(name, shape)| (name, shape, 0..shape[0]))
            .collect();
        self.concat_parts(&whole, dtype, device)
    }

    /// [`Checkpoint::concat`] of the rows `range` of each tensor (a tensor-parallel rank's
    /// share of each merged part); each tensor checked against its whole `shape`.
    pub fn concat_parts<const D: usize>(
        &mut self,
        parts: &[(&str, [usize; D], std::ops::Range<usize>)],
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor<D>> {
        let mut raws = Vec::with_capacity(parts.len());
        for (name, shape, rows) in parts {
            raws.push(self.raw(name, shape)?.slice(0, rows.clone()));
        }
        let src = raws[0].dtype;
        if raws.iter().any(|r| r.dtype != src) {
            return Err(ModelError::UnsupportedDtype {
                name: parts.iter().map(|p| p.0).collect::<Vec<_>>().join("+"),
                dtype: "mixed dtypes".into(),
            });
        }
        let mut shape = raws[0].shape.clone();
        shape[0] = raws.iter().map(|r| r.shape[0]).sum();
        // One copy per part (not a byte-wise iterator: these are the largest tensors).
        let mut bytes = Vec::with_capacity(raws.iter().map(|r| r.bytes.len()).sum());
        for raw in &raws {
            bytes.extend_from_slice(&raw.bytes);
        }
        Ok(RawTensor {
            bytes,
            dtype: src,
            shape,
        }
        .into_tensor(dtype, device))
    }

    /// Fails if the checkpoint holds tensors that were never read.
    pub fn finish(self) -> Result<()> {
        let unused: Vec<String> = self
            .index
            .into_keys()
            .filter(|n| !self.used.contains(n))
            .collect();
        if unused.is_empty() {
            Ok(())
        } else {
            Err(ModelError::UnexpectedTensors(unused))
        }
    }
}

impl RawTensor {
    /// The part `range` of dimension `dim` (a tensor-parallel rank's rows or columns), cut on
    /// the host.
    ///
    /// # Panics
    /// If `dim` or `range` is outside the shape.
    pub fn slice(self, dim: usize, range: std::ops::Range<usize>) -> Self {
        let (len, size) = (self.shape[dim], self.dtype.size());
        assert!(
            range.end <= len && range.start <= range.end,
            "slice {range:?} of {len}"
        );
        if range == (0..len) {
            return self;
        }
        let inner: usize = self.shape[dim + 1..].iter().product::<usize>() * size;
        let outer: usize = self.shape[..dim].iter().product();
        let mut bytes = Vec::with_capacity(outer * range.len() * inner);
        for o in 0..outer {
            let base = o * len * inner;
            bytes.extend_from_slice(
                &self.bytes[base + range.start * inner..base + range.end * inner],
            );
        }
        let mut shape = self.shape;
        shape[dim] = range.len();
        Self {
            bytes,
            dtype: self.dtype,
            shape,
        }
    }

    /// Uploads the bytes, converting to `dtype` on the host first.
    pub fn into_tensor<const D: usize>(self, dtype: DType, device: &Device) -> Tensor<D> {
        let data = TensorData::from_bytes_vec(self.bytes, self.shape, self.dtype);
        Tensor::from_data(data, (device, dtype))
    }
}

impl Shard {
    fn open(path: PathBuf) -> Result<Self> {
        let file = File::open(&path).map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                ModelError::MissingFile(path.clone())
            } else {
                ModelError::Io {
                    path: path.clone(),
                    source,
                }
            }
        })?;
        // SAFETY: the checkpoint is opened read-only and must not be modified while loaded.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|source| ModelError::Io {
            path: path.clone(),
            source,
        })?;
        let (header, metadata) =
            SafeTensors::read_metadata(&mmap).map_err(|e| ModelError::Safetensors {
                path: path.clone(),
                message: e.to_string(),
            })?;
        Ok(Self {
            path,
            mmap,
            data_start: 8 + header,
            metadata,
        })
    }
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let paths: Vec<_> = self.shards.iter().map(|s| &s.path).collect();
        f.debug_struct("Checkpoint")
            .field("shards", &paths)
            .field("tensors", &self.index.len())
            .finish()
    }
}
