//! Layering, enforced. Crates: each shipped crate sits in a layer (`CRATE_LAYERS`, the
//! picture of docs/architecture.md) and may depend only on crates of lower layers, so the
//! engine never learns of an edge and no edge of another. Modules: within each crate,
//! top-level modules depend on each other one way only. The module check reads the sources,
//! draws an edge from a module to every `crate::<module>` path its code names (comments and
//! unit tests left out), and fails on any dependency circle, so one cannot creep in unnoticed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use tollgate_e2e::repo_root;

/// The shipped crates from the bottom up; a crate may use crates of lower layers only.
const CRATE_LAYERS: &[&[&str]] = &[
    &["tollgate-limiter", "tollgate-crd", "tollgate-telemetry"],
    &["tollgate-global"],
    &["tollgate-engine"],
    &["tollgate-http", "tollgate-envoy", "tollgate-runtime"],
    &[
        "tollgate-sidecar",
        "tollgate-ratelimit",
        "tollgate-controller",
        "kubectl-tollgate",
    ],
];

/// Circles tolerated, per crate: none.
const KNOWN: &[(&str, &[&str])] = &[];

type Graph = BTreeMap<String, BTreeSet<String>>;

fn code_of(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests {") {
        Some(at) => &text[..at],
        None => text,
    };
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn collect(dir: &Path, src: &Path, graph: &mut Graph) {
    let path_ref = regex::Regex::new(r"\bcrate::([a-z_0-9]+)").unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            collect(&path, src, graph);
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let rel = path.strip_prefix(src).unwrap();
        if rel.iter().any(|c| c == "tests" || c == "tests.rs") {
            continue;
        }
        let first = rel.iter().next().unwrap().to_string_lossy();
        let module = first.trim_end_matches(".rs").to_string();
        let code = code_of(&std::fs::read_to_string(&path).unwrap());
        let deps = graph.entry(module.clone()).or_default();
        for m in path_ref.captures_iter(&code) {
            if m[1] != module {
                deps.insert(m[1].to_string());
            }
        }
    }
}

/// Strongly connected components of more than one module (Tarjan).
fn circles(graph: &Graph) -> Vec<Vec<String>> {
    struct State<'g> {
        graph: &'g Graph,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'g>(s: &mut State<'g>, v: &'g str) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        for w in s.graph.get(v).into_iter().flatten() {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                s.low.entry(v).and_modify(|l| *l = (*l).min(lw));
            } else if s.stack.contains(&w) {
                let iw = s.index[w];
                s.low.entry(v).and_modify(|l| *l = (*l).min(iw));
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                s.out.push(comp);
            }
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// The `tollgate-*` crates a manifest's `[dependencies]` (and `[build-dependencies]`) name.
fn tollgate_dependencies(manifest: &str) -> (String, BTreeSet<String>) {
    let mut name = String::new();
    let mut deps = BTreeSet::new();
    let mut section = String::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line.trim_matches(['[', ']']).to_string();
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        let key = key.trim().trim_end_matches(".workspace");
        if section == "package" && key == "name" {
            name = value.trim().trim_matches('"').to_string();
        }
        let runtime = section == "dependencies" || section == "build-dependencies";
        if runtime && (key.starts_with("tollgate-") || key == "kubectl-tollgate") {
            deps.insert(key.to_string());
        }
    }
    (name, deps)
}

/// Dependencies that do not point to a lower layer, as messages.
fn upward_dependencies(
    layers: &[&[&str]],
    deps: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<String> {
    let layer_of = |c: &str| layers.iter().position(|l| l.contains(&c));
    let mut out = Vec::new();
    for (krate, uses) in deps {
        let Some(mine) = layer_of(krate) else {
            out.push(format!(
                "{krate}: not in CRATE_LAYERS (place it in a layer)"
            ));
            continue;
        };
        for dep in uses {
            match layer_of(dep) {
                Some(theirs) if theirs < mine => {}
                Some(theirs) => out.push(format!(
                    "{krate} (layer {mine}) uses {dep} (layer {theirs}): dependencies point down only"
                )),
                None => out.push(format!("{krate} uses {dep}, which is in no layer")),
            }
        }
    }
    out
}

/// Every crate under `crates/` except test support.
fn shipped_crates() -> Vec<std::path::PathBuf> {
    let mut dirs: Vec<_> = std::fs::read_dir(repo_root().join("crates"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("Cargo.toml").is_file() && !p.ends_with("testkit"))
        .collect();
    dirs.sort();
    dirs
}

#[test]
fn crates_depend_on_lower_layers_only() {
    let mut deps = BTreeMap::new();
    for dir in shipped_crates() {
        let (name, uses) =
            tollgate_dependencies(&std::fs::read_to_string(dir.join("Cargo.toml")).unwrap());
        deps.insert(name, uses);
    }
    assert!(deps.len() >= 8, "too few crates found: {deps:?}");
    let wrong = upward_dependencies(CRATE_LAYERS, &deps);
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn the_crate_check_finds_upward_and_sideways_dependencies() {
    let layers: &[&[&str]] = &[&["tollgate-a"], &["tollgate-b", "tollgate-c"]];
    let (name, uses) = tollgate_dependencies(
        "[package]\nname = \"tollgate-b\"\n[dependencies]\ntollgate-a.workspace = true\n\
         tollgate-c = { path = \"../c\" }\nserde = \"1\"\n[dev-dependencies]\ntollgate-x.workspace = true\n",
    );
    assert_eq!(name, "tollgate-b");
    let deps: BTreeMap<String, BTreeSet<String>> = [
        (name, uses),
        ("tollgate-a".to_string(), ["tollgate-b".to_string()].into()),
    ]
    .into();
    assert_eq!(
        upward_dependencies(layers, &deps),
        vec![
            "tollgate-a (layer 0) uses tollgate-b (layer 1): dependencies point down only",
            "tollgate-b (layer 1) uses tollgate-c (layer 1): dependencies point down only",
        ]
    );
}

#[test]
fn modules_depend_on_each_other_one_way() {
    let mut failures = Vec::new();
    for dir in shipped_crates() {
        let krate = dir.file_name().unwrap().to_string_lossy().to_string();
        let src = dir.join("src");
        let mut graph = Graph::new();
        collect(&src, &src, &mut graph);
        assert!(
            graph.len() > 1,
            "{krate}: no modules found in {}",
            src.display()
        );
        let known: Vec<Vec<String>> = KNOWN
            .iter()
            .filter(|(k, _)| *k == krate)
            .map(|(_, c)| c.iter().map(ToString::to_string).collect())
            .collect();
        let found = circles(&graph);
        if found != known {
            failures.push(format!(
                "{krate}: dependency circles {found:?}, expected {known:?}\n  edges: {graph:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_circle_finder_finds_circles() {
    let graph: Graph = [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("e", "d")]
        .into_iter()
        .fold(Graph::new(), |mut g, (from, to)| {
            g.entry(from.into()).or_default().insert(to.into());
            g
        });
    assert_eq!(circles(&graph), vec![vec!["a", "b", "c"]]);
}
