//! Layering: within each crate, top-level modules depend on each other one way only. Reads
//! the sources, draws an edge from a module to every `crate::<module>` path its code names
//! (comments and unit tests left out), and fails on any dependency circle, so one cannot creep
//! in unnoticed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use tollgate_e2e::repo_root;

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

#[test]
fn modules_depend_on_each_other_one_way() {
    let root = repo_root();
    let mut failures = Vec::new();
    for krate in [
        "controller",
        "sidecar",
        "crd",
        "limiter",
        "kubectl-tollgate",
    ] {
        let src = root.join("crates").join(krate).join("src");
        if !src.is_dir() {
            continue;
        }
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
