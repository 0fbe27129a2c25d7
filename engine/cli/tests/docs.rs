//! The documentation holds to the code: every configuration key is in
//! `docs/configuration.md`, every source file in `docs/architecture.md`'s table of rooms, every
//! `tl` command in the README's table, and every relative link of the README and `docs/`
//! resolves.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::de::{self, DeserializeSeed, IntoDeserializer, MapAccess, Visitor};

/// The repository's root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .unwrap()
        .to_owned()
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

type Error = de::value::Error;

/// A deserializer that feeds a type's `Deserialize` every field it names, with a zero value,
/// and records each field's dotted path: the configuration's keys as serde sees them, `skip`ped
/// fields left out.
struct Keys<'a> {
    path: String,
    out: &'a RefCell<BTreeSet<String>>,
}

struct Fields<'a> {
    path: String,
    fields: &'static [&'static str],
    next: usize,
    out: &'a RefCell<BTreeSet<String>>,
}

impl<'de> MapAccess<'de> for Fields<'_> {
    type Error = Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Error> {
        let Some(f) = self.fields.get(self.next) else {
            return Ok(None);
        };
        seed.deserialize((*f).into_deserializer()).map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Error> {
        let f = self.fields[self.next];
        self.next += 1;
        let path = if self.path.is_empty() {
            f.to_owned()
        } else {
            format!("{}.{f}", self.path)
        };
        self.out.borrow_mut().insert(path.clone());
        seed.deserialize(Keys {
            path,
            out: self.out,
        })
    }
}

struct NoItems;

impl<'de> de::SeqAccess<'de> for NoItems {
    type Error = Error;
    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        _: T,
    ) -> Result<Option<T::Value>, Error> {
        Ok(None)
    }
}

impl<'de> MapAccess<'de> for NoItems {
    type Error = Error;
    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, _: K) -> Result<Option<K::Value>, Error> {
        Ok(None)
    }
    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, _: V) -> Result<V::Value, Error> {
        Err(de::Error::custom("no values"))
    }
}

impl<'de> de::Deserializer<'de> for Keys<'_> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_unit()
    }
    fn deserialize_bool<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_bool(false)
    }
    fn deserialize_i8<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_i64(0)
    }
    fn deserialize_i16<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_i64(0)
    }
    fn deserialize_i32<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_i64(0)
    }
    fn deserialize_i64<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_i64(0)
    }
    fn deserialize_u8<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_u64(0)
    }
    fn deserialize_u16<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_u64(0)
    }
    fn deserialize_u32<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_u64(0)
    }
    fn deserialize_u64<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_u64(0)
    }
    fn deserialize_f32<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_f64(0.0)
    }
    fn deserialize_f64<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_f64(0.0)
    }
    fn deserialize_char<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_char('x')
    }
    fn deserialize_str<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_str("")
    }
    fn deserialize_string<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_str("")
    }
    fn deserialize_bytes<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_bytes(b"")
    }
    fn deserialize_byte_buf<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_bytes(b"")
    }
    fn deserialize_option<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_some(self)
    }
    fn deserialize_unit<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_unit()
    }
    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        v: V,
    ) -> Result<V::Value, Error> {
        v.visit_unit()
    }
    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        v: V,
    ) -> Result<V::Value, Error> {
        v.visit_newtype_struct(self)
    }
    fn deserialize_seq<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_seq(NoItems)
    }
    fn deserialize_tuple<V: Visitor<'de>>(self, _: usize, v: V) -> Result<V::Value, Error> {
        v.visit_seq(NoItems)
    }
    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: usize,
        v: V,
    ) -> Result<V::Value, Error> {
        v.visit_seq(NoItems)
    }
    fn deserialize_map<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_map(NoItems)
    }
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, Error> {
        v.visit_map(Fields {
            path: self.path,
            fields,
            next: 0,
            out: self.out,
        })
    }
    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _: &'static str,
        variants: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, Error> {
        v.visit_enum(variants[0].into_deserializer())
    }
    fn deserialize_identifier<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_str("")
    }
    fn deserialize_ignored_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_unit()
    }
}

/// The leaf keys of configuration type `T`, dotted (`gateway.public_tls.cert`).
fn keys_of<T: for<'de> serde::Deserialize<'de>>() -> BTreeSet<String> {
    let out = RefCell::new(BTreeSet::new());
    let r = T::deserialize(Keys {
        path: String::new(),
        out: &out,
    });
    let all = out.into_inner();
    assert!(r.is_ok() || !all.is_empty(), "{:?}", r.err());
    all.iter()
        .filter(|k| !all.iter().any(|o| o.starts_with(&format!("{k}."))))
        .cloned()
        .collect()
}

/// The keys `docs/configuration.md` documents: under a heading naming a table (`[engine]`,
/// `[gateway.public_tls]`, or "top level"), each row starting with the key in backticks.
fn documented() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut section: Option<String> = None;
    for line in read("docs/configuration.md").lines() {
        if let Some(h) = line.strip_prefix("## ") {
            section = if h.to_ascii_lowercase().starts_with("top level") {
                Some(String::new())
            } else {
                h.split_once("`[")
                    .and_then(|(_, r)| r.split_once("]`"))
                    .map(|(s, _)| s.to_owned())
            };
            continue;
        }
        if let (Some(s), Some(rest)) = (&section, line.strip_prefix("| `"))
            && let Some((key, _)) = rest.split_once('`')
        {
            out.insert(if s.is_empty() {
                key.to_owned()
            } else {
                format!("{s}.{key}")
            });
        }
    }
    out
}

#[test]
fn every_configuration_key_is_documented() {
    let engine = keys_of::<tl_engine::node::config::Config>();
    let gateway = keys_of::<tl_engine::gateway::config::GatewayConfig>();
    assert!(
        engine.contains("engine.role") && engine.contains("limits.max_pushes"),
        "{engine:?}"
    );
    assert!(gateway.contains("gateway.max_inflight"), "{gateway:?}");
    let docs = documented();
    let missing: Vec<_> = engine
        .union(&gateway)
        .filter(|k| !docs.contains(*k))
        .collect();
    assert!(
        missing.is_empty(),
        "keys missing from docs/configuration.md: {missing:?}"
    );
    let stale: Vec<_> = docs
        .iter()
        .filter(|k| !engine.contains(*k) && !gateway.contains(*k))
        .collect();
    assert!(
        stale.is_empty(),
        "docs/configuration.md documents keys no configuration has: {stale:?}"
    );
}

/// The source files of the workspace's crates, relative to the root.
fn source_files() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut stack: Vec<PathBuf> = [
        "kvwire/src",
        "kvwire-grpc/src",
        "engine/core/src",
        "engine/llama/src",
        "engine/src",
        "engine/lab/src",
        "engine/cli/src",
    ]
    .iter()
    .map(|d| root().join(d))
    .collect();
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let rel = p.strip_prefix(root()).unwrap();
                out.insert(rel.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    out
}

#[test]
fn every_source_file_is_in_the_architecture_table() {
    let doc = read("docs/architecture.md");
    let listed: BTreeSet<String> = doc
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|r| r.split_once('`').map(|(f, _)| f.to_owned()))
        .filter(|f| f.ends_with(".rs"))
        .collect();
    let files = source_files();
    assert!(files.len() > 100, "{}", files.len());
    let missing: Vec<_> = files.difference(&listed).collect();
    assert!(
        missing.is_empty(),
        "files missing from docs/architecture.md: {missing:?}"
    );
    let gone: Vec<_> = listed.difference(&files).collect();
    assert!(
        gone.is_empty(),
        "docs/architecture.md lists files that are gone: {gone:?}"
    );
}

/// The subcommands `tl ARGS --help` lists.
fn subcommands(args: &[&str]) -> Vec<String> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tl"))
        .args(args)
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    text.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_tl_command_is_in_the_readmes_table() {
    let readme = read("README.md");
    let mut missing = Vec::new();
    let top = subcommands(&[]);
    assert!(top.len() >= 12, "{top:?}");
    for c in &top {
        let nested = if matches!(c.as_str(), "bench" | "etcd" | "model") {
            subcommands(&[c])
        } else {
            Vec::new()
        };
        if nested.is_empty() {
            if !readme.contains(&format!("| `tl {c}")) {
                missing.push(c.clone());
            }
        } else {
            for n in nested {
                let row = format!("| `tl {c} {n}");
                let listed = readme.contains(&row)
                    || readme
                        .lines()
                        .any(|l| l.starts_with(&format!("| `tl {c} ")) && l.contains(&n));
                if !listed {
                    missing.push(format!("{c} {n}"));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "commands missing from the README's table: {missing:?}"
    );
}

/// Every relative link target of `text` (a markdown file at `at`), without its anchor.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fence = false;
    for line in text.lines() {
        if line.starts_with("```") {
            fence = !fence;
        }
        if fence {
            continue;
        }
        let mut rest = line;
        while let Some(i) = rest.find("](") {
            rest = &rest[i + 2..];
            let Some(end) = rest.find(')') else { break };
            let target = &rest[..end];
            rest = &rest[end..];
            if target.contains("://") || target.starts_with('#') || target.starts_with("mailto:") {
                continue;
            }
            let path = target.split('#').next().unwrap_or_default();
            if !path.is_empty() {
                out.push(path.to_owned());
            }
        }
    }
    out
}

#[test]
fn every_relative_link_resolves() {
    let mut pages = vec![root().join("README.md"), root().join("SECURITY.md")];
    let mut stack = vec![root().join("docs"), root().join("spec")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "md") {
                pages.push(p);
            }
        }
    }
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        for l in links(&text) {
            checked += 1;
            if !page.parent().unwrap().join(&l).exists() {
                broken.push(format!(
                    "{}: {l}",
                    page.strip_prefix(root()).unwrap().display()
                ));
            }
        }
    }
    assert!(checked > 30, "{checked} links");
    assert!(
        broken.is_empty(),
        "links that resolve to nothing: {broken:#?}"
    );
}

#[test]
fn the_readme_is_short_and_cites_no_missing_contract() {
    let readme = read("README.md");
    let lines = readme.lines().count();
    assert!(lines <= 600, "the README has {lines} lines");
    for page in ["README.md", "SECURITY.md"] {
        assert!(
            !read(page).contains("CONTRACTS"),
            "{page} cites a document outside the repository"
        );
    }
}
