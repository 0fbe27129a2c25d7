//! A checkpoint's tensors: `model.safetensors`, or the shards that `model.safetensors.index.json`
//! lists, read once into memory of the process's own (a file truncated under a running engine
//! cannot take it away), or a GGUF file's tensors dequantized at load. A tensor is a range of
//! that memory, read through [`MatRef`] in its own dtype.

use std::collections::HashMap;
use std::path::Path;

use crate::config::CheckpointError;
use crate::kernels::{DType, MatRef};

/// Where one tensor lies.
#[derive(Clone, Debug)]
struct Entry {
    file: usize,
    start: usize,
    end: usize,
    dtype: DType,
    shape: Vec<usize>,
}

/// A checked matrix of a [`Weights`], resolved once at load: where its bytes lie.
#[derive(Clone, Copy, Debug)]
pub struct Tensor {
    file: usize,
    start: usize,
    end: usize,
    dtype: DType,
    rows: usize,
    cols: usize,
}

/// A checkpoint's bytes, in memory of the process's own, 8-byte aligned (as a mapped file's
/// pages were, so the kernels read bf16, f16 and f32 in place): a file changed or truncated
/// while it is served changes nothing, where a mapped one would fault (SIGBUS) on the next
/// read of a page it no longer has.
struct Backing {
    words: Vec<u64>,
    len: usize,
}

impl Backing {
    fn zeroed(len: usize) -> Self {
        Self {
            words: vec![0u64; len.div_ceil(8)],
            len,
        }
    }

    fn from_bytes(bytes: &[u8]) -> Self {
        let mut b = Self::zeroed(bytes.len());
        b.bytes_mut().copy_from_slice(bytes);
        b
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }

    /// The whole of `file` (`len` bytes as its metadata said), read once.
    fn read(file: &mut std::fs::File, len: usize) -> std::io::Result<Self> {
        use std::io::Read;
        let mut b = Self::zeroed(len);
        file.read_exact(b.bytes_mut())?;
        Ok(b)
    }
}

impl std::ops::Deref for Backing {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }
}

/// The largest shard read.
const MAX_SHARD_BYTES: usize = 256 << 30;

/// The files (or buffers) of a checkpoint and the tensors in them.
pub struct Weights {
    maps: Vec<Backing>,
    tensors: HashMap<String, Entry>,
}

impl std::fmt::Debug for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Weights")
            .field("files", &self.maps.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

fn io(path: &Path, source: std::io::Error) -> CheckpointError {
    CheckpointError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn bad(path: &Path, message: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Safetensors {
        path: path.display().to_string(),
        message: message.to_string(),
    }
}

impl Weights {
    /// Maps the checkpoint in `dir`: the shards of `model.safetensors.index.json` when it
    /// exists, else `model.safetensors`.
    ///
    /// # Errors
    /// An unreadable or malformed file, a tensor of a dtype other than BF16, F16 or F32.
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<String> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| io(&index, e))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| CheckpointError::Json {
                    path: index.display().to_string(),
                    message: e.to_string(),
                })?;
            let map = v
                .get("weight_map")
                .and_then(serde_json::Value::as_object)
                .ok_or_else(|| CheckpointError::Json {
                    path: index.display().to_string(),
                    message: "no weight_map object".into(),
                })?;
            let mut files: Vec<String> = map
                .values()
                .filter_map(|f| f.as_str().map(str::to_owned))
                .collect();
            files.sort();
            files.dedup();
            files
        } else {
            vec!["model.safetensors".into()]
        };
        let mut maps = Vec::new();
        let mut tensors = HashMap::new();
        for (i, name) in files.iter().enumerate() {
            if name.contains('/') || name.contains("..") {
                return Err(bad(
                    &index,
                    format!("shard name {name:?} leaves the directory"),
                ));
            }
            let path = dir.join(name);
            let mut file = std::fs::File::open(&path).map_err(|e| io(&path, e))?;
            let len = file.metadata().map_err(|e| io(&path, e))?.len();
            let len = usize::try_from(len)
                .ok()
                .filter(|&l| l <= MAX_SHARD_BYTES)
                .ok_or_else(|| bad(&path, format!("{len} bytes: a shard is at most 256 GiB")))?;
            // Read, not mapped: see [`Backing`]. A file that shrinks while it is read is an
            // I/O error here.
            let map = Backing::read(&mut file, len).map_err(|e| io(&path, e))?;
            let (header, meta) = safetensors::SafeTensors::read_metadata(&map[..])
                .map_err(|e| bad(&path, format!("{e:?}")))?;
            let base = 8 + header;
            for (tname, info) in meta.tensors() {
                let dtype = match info.dtype {
                    safetensors::Dtype::BF16 => DType::Bf16,
                    safetensors::Dtype::F16 => DType::F16,
                    safetensors::Dtype::F32 => DType::F32,
                    other => {
                        return Err(CheckpointError::Dtype {
                            name: tname,
                            dtype: format!("{other:?}"),
                        });
                    }
                };
                let (s, e) = info.data_offsets;
                if base + e > map.len() || s > e {
                    return Err(bad(&path, format!("tensor {tname} lies outside the file")));
                }
                tensors.insert(
                    tname,
                    Entry {
                        file: i,
                        start: base + s,
                        end: base + e,
                        dtype,
                        shape: info.shape.clone(),
                    },
                );
            }
            maps.push(map);
        }
        Ok(Self { maps, tensors })
    }

    /// Tensors held in memory: each `(name, dtype, shape, bytes)`.
    #[must_use]
    pub fn owned(list: Vec<(String, DType, Vec<usize>, Vec<u8>)>) -> Self {
        let mut maps = Vec::with_capacity(list.len());
        let mut tensors = HashMap::with_capacity(list.len());
        for (i, (name, dtype, shape, bytes)) in list.into_iter().enumerate() {
            tensors.insert(
                name,
                Entry {
                    file: i,
                    start: 0,
                    end: bytes.len(),
                    dtype,
                    shape,
                },
            );
            maps.push(Backing::from_bytes(&bytes));
        }
        Self { maps, tensors }
    }

    /// Every tensor: its name, dtype, shape and bytes (for exporting a checkpoint).
    #[must_use]
    pub fn entries(&self) -> Vec<(&str, DType, &[usize], &[u8])> {
        let mut v: Vec<_> = self
            .tensors
            .iter()
            .map(|(n, e)| {
                (
                    n.as_str(),
                    e.dtype,
                    e.shape.as_slice(),
                    &self.maps[e.file][e.start..e.end],
                )
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(b.0));
        v
    }

    /// Whether the checkpoint holds `name`.
    #[must_use]
    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The matrix a handle names.
    #[must_use]
    pub fn get(&self, t: Tensor) -> MatRef<'_> {
        MatRef {
            bytes: &self.maps[t.file][t.start..t.end],
            dtype: t.dtype,
            rows: t.rows,
            cols: t.cols,
        }
    }

    /// Tensor `name`, checked to have shape `shape` (a vector is one row), as a handle.
    ///
    /// # Errors
    /// [`CheckpointError::MissingTensor`] or [`CheckpointError::Shape`].
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor, CheckpointError> {
        let m = self.mat(name, shape)?;
        let e = &self.tensors[name];
        Ok(Tensor {
            file: e.file,
            start: e.start,
            end: e.end,
            dtype: m.dtype,
            rows: m.rows,
            cols: m.cols,
        })
    }

    /// Tensor `name` as a matrix of shape `shape` (a vector is one row).
    ///
    /// # Errors
    /// [`CheckpointError::MissingTensor`] or [`CheckpointError::Shape`].
    pub fn mat(&self, name: &str, shape: &[usize]) -> Result<MatRef<'_>, CheckpointError> {
        let e = self
            .tensors
            .get(name)
            .ok_or_else(|| CheckpointError::MissingTensor(name.to_owned()))?;
        if e.shape != shape {
            return Err(CheckpointError::Shape {
                name: name.to_owned(),
                got: e.shape.clone(),
                want: shape.to_vec(),
            });
        }
        let bytes = &self.maps[e.file][e.start..e.end];
        let (rows, cols) = match shape {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            _ => (0, 0),
        };
        if cols % e.dtype.block_values() != 0 || bytes.len() != rows * e.dtype.row_bytes(cols) {
            return Err(CheckpointError::Shape {
                name: name.to_owned(),
                got: vec![bytes.len() / e.dtype.size() * e.dtype.block_values()],
                want: vec![rows * cols],
            });
        }
        Ok(MatRef {
            bytes,
            dtype: e.dtype,
            rows,
            cols,
        })
    }

    /// A vector tensor widened to f32.
    ///
    /// # Errors
    /// As [`mat`](Self::mat).
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, CheckpointError> {
        let m = self.mat(name, &[len])?;
        let mut v = vec![0f32; len];
        m.row_into(0, &mut v);
        Ok(v)
    }
}
