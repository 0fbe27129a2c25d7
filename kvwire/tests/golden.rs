//! The writer against the independent Python generator's blobs in `parity/kv.wire.v1`.

use std::path::PathBuf;

use kvwire::{ErrorKind, Kv, Pos, Reader, RecordIn, Shape, block_hash, f16, write_to_vec};
use serde_json::Value;
use sha2::{Digest, Sha256};

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../parity/kv.wire.v1")
}

fn shape_of(v: &Value) -> Shape {
    let d: Vec<u32> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    Shape::v1(d[0], d[1], d[2], d[3])
}

/// The manifest's value rule, written again here from its description.
fn payload(shape: &Shape, fill: u32, values: &Value) -> Vec<u8> {
    if let Some(list) = values.get("explicit") {
        return list
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|v| f16::from_f64(v.as_f64().unwrap()).to_le_bytes())
            .collect();
    }
    let s = values["pattern"].as_u64().unwrap() as i64;
    let mut out = vec![0xEEu8; shape.payload_bytes().unwrap()]; // garbage the writer must zero
    let dm = shape.dims;
    for layer in 0..dm.n_layers {
        for kv in [Kv::K, Kv::V] {
            for token in 0..fill {
                for head in 0..dm.n_kv_heads {
                    for dim in 0..dm.head_dim {
                        let n = (s * 31
                            + i64::from(layer) * 17
                            + kv as i64 * 7
                            + i64::from(token) * 5
                            + i64::from(head) * 3
                            + i64::from(dim))
                            % 61
                            - 30;
                        let pos = Pos {
                            layer,
                            kv,
                            token,
                            head,
                            dim,
                        };
                        assert!(shape.put_f16(&mut out, pos, f16::from_f64(n as f64 / 8.0)));
                    }
                }
            }
        }
    }
    out
}

fn kind_of(name: &str) -> ErrorKind {
    match name {
        "format" => ErrorKind::Format,
        "version" => ErrorKind::Version,
        "shape" => ErrorKind::Shape,
        other => panic!("unknown kind {other}"),
    }
}

#[test]
fn rust_writer_matches_the_golden_blobs() {
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(dir().join("manifest.json")).unwrap())
            .unwrap();
    let (mut valid, mut refused) = (0, 0);
    for case in manifest["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let file = dir().join(case["file"].as_str().unwrap());
        if case.get("from").is_some() {
            let bytes = std::fs::read(&file).unwrap();
            let mut reader = Reader::new();
            if let Some(s) = case.get("expect_shape") {
                reader = reader.expect_shape(shape_of(s));
            }
            let err = reader.read(&bytes).expect_err(name);
            let want = &case["expect"];
            assert_eq!(
                err.kind(),
                kind_of(want["kind"].as_str().unwrap()),
                "{name}: {err}"
            );
            assert_eq!(
                u64::from(err.rule()),
                want["rule"].as_u64().unwrap(),
                "{name}: {err}"
            );
            refused += 1;
            continue;
        }

        let shape = shape_of(&case["shape"]);
        let blocks = case["blocks"].as_array().unwrap();
        let mut parent = 0;
        let mut payloads = Vec::new();
        let mut heads = Vec::new();
        for blk in blocks {
            let tokens: Vec<u32> = blk["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            let fill = blk["fill"].as_u64().unwrap() as u32;
            let hash = if blk["hash"] == "chain" {
                parent = block_hash(parent, &tokens);
                parent
            } else {
                blk["hash"].as_u64().unwrap()
            };
            payloads.push(payload(&shape, fill, &blk["values"]));
            heads.push((hash, fill));
        }
        let records: Vec<RecordIn<'_>> = heads
            .iter()
            .zip(&payloads)
            .map(|(&(hash, fill), p)| RecordIn {
                hash,
                fill,
                payload: p,
            })
            .collect();
        let mut out = Vec::new();
        write_to_vec(&shape, &records, &mut out).unwrap();

        if case.get("commit") == Some(&Value::Bool(false)) {
            let digest: String = Sha256::digest(&out)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            assert_eq!(digest, case["sha256"].as_str().unwrap(), "{name}");
        } else {
            assert_eq!(out, std::fs::read(&file).unwrap(), "{name}");
        }

        let env = Reader::new().expect_shape(shape).read(&out).unwrap();
        assert_eq!(env.n_blocks(), records.len());
        for (rec, (&(hash, fill), _)) in env.records().zip(heads.iter().zip(&payloads)) {
            assert_eq!((rec.hash, rec.n_tokens), (hash, fill), "{name}");
            // Slots past the fill read back as zeros.
            let row = shape.row_bytes().unwrap();
            for plane in rec
                .payload
                .chunks_exact(row * shape.block_tokens() as usize)
            {
                assert!(
                    plane[row * fill as usize..].iter().all(|&b| b == 0),
                    "{name}"
                );
            }
        }
        valid += 1;
    }
    assert_eq!((valid, refused), (6, 13));
}
