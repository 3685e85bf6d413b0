//! Decoding policies from YAML or JSON, refusing fields the API does not define.
//!
//! Serde's derived deserialisers skip unknown fields, so `burts: 5` (for `burst`) would give the
//! user a different policy than written, silently. Decoding stays lenient (so a stored object
//! with an extra field still decodes and the caller can keep every other policy running), but
//! every skipped field is collected, with its path, through [`serde_ignored`], and the strict
//! entry points ([`parse_yaml`], [`Decoded::compile`], the admission webhook) turn them into
//! [`FieldError`]s such as `spec.rules[0].limit.burts: unknown field (did you mean `burst`?)`.
//!
//! Unknown fields under `status` are never reported: status is written by the controller and
//! may carry fields a newer version added.

use std::sync::OnceLock;

use serde::Deserialize;

use crate::compile::{CompileErrors, FieldError, compile};
use crate::compiled::CompiledPolicy;
use crate::policy::RateLimitPolicy;

/// `kube::Resource` for a type that is read from RateLimitPolicy objects: the kind, group,
/// version and plural are the policy's, the metadata wherever the type keeps it.
macro_rules! policy_resource {
    ($ty:ty, |$r:ident| $meta:expr, |$m:ident| $meta_mut:expr) => {
        impl kube::Resource for $ty {
            type DynamicType = ();
            type Scope = kube::core::NamespaceResourceScope;

            fn kind(dt: &()) -> std::borrow::Cow<'_, str> {
                RateLimitPolicy::kind(dt)
            }
            fn group(dt: &()) -> std::borrow::Cow<'_, str> {
                RateLimitPolicy::group(dt)
            }
            fn version(dt: &()) -> std::borrow::Cow<'_, str> {
                RateLimitPolicy::version(dt)
            }
            fn plural(dt: &()) -> std::borrow::Cow<'_, str> {
                RateLimitPolicy::plural(dt)
            }
            fn meta(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                let $r = self;
                $meta
            }
            fn meta_mut(
                &mut self,
            ) -> &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                let $m = self;
                $meta_mut
            }
        }
    };
}

/// A decoded policy and the fields of it that the `RateLimitPolicy` API does not define.
#[derive(Debug, Clone)]
pub struct Decoded {
    pub policy: RateLimitPolicy,
    /// One `<path>: unknown field ...` error per unknown field, in document order.
    pub unknown_fields: Vec<FieldError>,
}

impl From<RateLimitPolicy> for Decoded {
    /// A policy built in code: it has no unknown fields.
    fn from(policy: RateLimitPolicy) -> Decoded {
        Decoded {
            policy,
            unknown_fields: Vec::new(),
        }
    }
}

/// Decodes like [`from_json`], so a watch of `Decoded` objects sees their unknown fields.
impl<'de> Deserialize<'de> for Decoded {
    fn deserialize<D: serde::Deserializer<'de>>(de: D) -> Result<Decoded, D::Error> {
        decode(de, "object").map_err(serde::de::Error::custom)
    }
}

// The policy's resource, so `Api<Decoded>` lists and watches RateLimitPolicies.
policy_resource!(Decoded, |d| d.policy.meta(), |d| d.policy.meta_mut());

/// A policy read for its metadata and status only, whatever its spec holds. Listing
/// `RateLimitPolicy` objects fails as a whole when one of them does not decode (a required field
/// missing, stored while no validating webhook ran: the schema leaves required fields to
/// admission); reports that only show status (`kubectl tollgate status`, `top`) list these.
#[derive(Debug, Clone, Deserialize)]
pub struct PolicyStatusView {
    #[serde(default)]
    pub metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    #[serde(default)]
    pub status: Option<crate::RateLimitPolicyStatus>,
}

// The policy's resource, so `Api<PolicyStatusView>` lists RateLimitPolicies.
policy_resource!(PolicyStatusView, |v| &v.metadata, |v| &mut v.metadata);

impl Decoded {
    /// Keeps only the unknown fields under `spec`: for objects from the API server, which
    /// prunes (or, asked to, refuses) unknown fields at the root and in `metadata` itself, and
    /// whose `metadata` may carry fields newer than this build. Only `spec` is kept for tollgate
    /// to judge (the CRD marks it `x-kubernetes-preserve-unknown-fields`).
    pub fn only_spec(mut self) -> Decoded {
        self.unknown_fields = self.unknown_spec_fields();
        self
    }

    /// The unknown fields under `spec` (see [`Decoded::only_spec`]).
    pub fn unknown_spec_fields(&self) -> Vec<FieldError> {
        self.unknown_fields
            .iter()
            .filter(|e| e.path.starts_with("spec.") || e.path.starts_with("spec["))
            .cloned()
            .collect()
    }

    /// Compiles the policy; unknown fields are errors, reported before the compile errors.
    pub fn compile(&self) -> Result<CompiledPolicy, CompileErrors> {
        let compiled = compile(&self.policy);
        if self.unknown_fields.is_empty() {
            return compiled;
        }
        let mut errors = self.unknown_fields.clone();
        if let Err(more) = compiled {
            errors.extend(more.0);
        }
        Err(CompileErrors(errors))
    }
}

/// Why a policy could not be decoded at all: the first value of the wrong type or missing
/// required field, and the unknown fields met before it. A misspelled required field is both
/// (`limt:` leaves `limit` missing), and the misspelling is what the user needs to see.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError {
    /// One `<path>: unknown field ...` error per unknown field seen before `error`.
    pub unknown_fields: Vec<FieldError>,
    pub error: FieldError,
}

impl DecodeError {
    /// Every error, unknown fields first (they usually explain `error`).
    pub fn errors(&self) -> Vec<FieldError> {
        let mut all = self.unknown_fields.clone();
        all.push(self.error.clone());
        all
    }
}

/// `path: message` per error, separated by `; ` (one line, as in an admission denial).
impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for e in &self.unknown_fields {
            write!(f, "{e}; ")?;
        }
        write!(f, "{}", self.error)
    }
}

impl std::error::Error for DecodeError {}

impl From<DecodeError> for CompileErrors {
    fn from(e: DecodeError) -> CompileErrors {
        CompileErrors(e.errors())
    }
}

impl From<FieldError> for DecodeError {
    fn from(error: FieldError) -> DecodeError {
        DecodeError {
            unknown_fields: Vec::new(),
            error,
        }
    }
}

/// Decodes a policy object (what the API server sends an admission webhook). Fails only on
/// values of the wrong type or missing required fields (with the unknown fields seen before);
/// unknown fields are collected.
pub fn from_json(value: serde_json::Value) -> Result<Decoded, DecodeError> {
    decode(value, "object")
}

/// Parses one or more YAML documents holding `RateLimitPolicy` objects (empty documents are
/// skipped), collecting each one's unknown fields. Errors name the document index.
pub fn parse_yaml_documents(text: &str) -> Result<Vec<Decoded>, DecodeError> {
    let mut out = Vec::new();
    for (i, doc) in serde_norway::Deserializer::from_str(text).enumerate() {
        let value = serde_norway::Value::deserialize(doc).map_err(|e| FieldError {
            path: format!("document {i}"),
            message: format!("not valid YAML: {e}"),
        })?;
        if value.is_null() {
            continue;
        }
        let kind = value.get("kind").and_then(|k| k.as_str()).unwrap_or("");
        if kind != "RateLimitPolicy" {
            return Err(FieldError {
                path: format!("document {i}.kind"),
                message: format!("expected RateLimitPolicy, found {kind:?}"),
            }
            .into());
        }
        let api = value
            .get("apiVersion")
            .and_then(|k| k.as_str())
            .unwrap_or("");
        if api != "tollgate.dev/v1alpha1" {
            return Err(FieldError {
                path: format!("document {i}.apiVersion"),
                message: format!("expected tollgate.dev/v1alpha1, found {api:?}"),
            }
            .into());
        }
        out.push(decode(value, &format!("document {i}"))?);
    }
    Ok(out)
}

/// Parses one or more YAML documents holding `RateLimitPolicy` objects (empty documents are
/// skipped). Unknown fields are errors: all of them are returned, each with its path.
pub fn parse_yaml(text: &str) -> Result<Vec<RateLimitPolicy>, CompileErrors> {
    let docs = parse_yaml_documents(text).map_err(CompileErrors::from)?;
    let unknown: Vec<FieldError> = docs
        .iter()
        .flat_map(|d| d.unknown_fields.iter().cloned())
        .collect();
    if !unknown.is_empty() {
        return Err(CompileErrors(unknown));
    }
    Ok(docs.into_iter().map(|d| d.policy).collect())
}

/// One step of a field path.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Key(String),
    Index(usize),
}

fn decode<'de, D>(de: D, whole: &str) -> Result<Decoded, DecodeError>
where
    D: serde::Deserializer<'de>,
{
    let mut ignored: Vec<Vec<Segment>> = Vec::new();
    let mut record = |path: serde_ignored::Path<'_>| {
        let mut segments = Vec::new();
        segments_of(&path, &mut segments);
        ignored.push(segments);
    };
    let decoded: Result<RateLimitPolicy, _> =
        serde_path_to_error::deserialize(serde_ignored::Deserializer::new(de, &mut record));
    let unknown_fields = ignored
        .iter()
        .filter(|p| !is_exempt(p))
        .map(|p| unknown_field_error(p))
        .collect();
    match decoded {
        Ok(policy) => Ok(Decoded {
            policy,
            unknown_fields,
        }),
        Err(e) => Err(DecodeError {
            unknown_fields,
            error: decode_error(e, whole),
        }),
    }
}

/// The serde error as a field error. A missing field is reported at its own path, in the API
/// server's words (`spec.rules[0].limit: Required value`), not at its parent's.
fn decode_error<E: std::fmt::Display>(e: serde_path_to_error::Error<E>, whole: &str) -> FieldError {
    let parent = e.path().to_string();
    let parent = if parent == "." {
        whole.to_string()
    } else {
        parent
    };
    let message = e.into_inner().to_string();
    // serde_json and serde_norway say "missing field `limit`"; the value-based deserialiser a
    // watch decodes through says "Missing field limit".
    let missing = message
        .strip_prefix("missing field ")
        .or_else(|| message.strip_prefix("Missing field "))
        .map(|rest| rest.trim_matches('`'))
        .filter(|field| !field.is_empty() && !field.contains(' '));
    match missing {
        Some(field) if parent == whole => FieldError {
            path: field.to_string(),
            message: "Required value".into(),
        },
        Some(field) => FieldError {
            path: format!("{parent}.{field}"),
            message: "Required value".into(),
        },
        None => FieldError {
            path: parent,
            message,
        },
    }
}

/// `status` (written by the controller; a newer one may add fields) and the type fields, which
/// the generated root deserialiser skips and [`parse_yaml_documents`] (or the API server)
/// checks on its own.
fn is_exempt(path: &[Segment]) -> bool {
    match path.first() {
        Some(Segment::Key(k)) => {
            k == "status" || (path.len() == 1 && ROOT_FIELDS[..2].contains(&k.as_str()))
        }
        _ => false,
    }
}

/// The root's fields; the CRD schema leaves the first three to the API server.
const ROOT_FIELDS: [&str; 5] = ["apiVersion", "kind", "metadata", "spec", "status"];

fn segments_of(path: &serde_ignored::Path<'_>, out: &mut Vec<Segment>) {
    use serde_ignored::Path;
    match path {
        Path::Root => {}
        Path::Seq { parent, index } => {
            segments_of(parent, out);
            out.push(Segment::Index(*index));
        }
        Path::Map { parent, key } => {
            segments_of(parent, out);
            out.push(Segment::Key(key.clone()));
        }
        Path::Some { parent }
        | Path::NewtypeStruct { parent }
        | Path::NewtypeVariant { parent } => segments_of(parent, out),
    }
}

/// `spec.rules[0].limit.burts`.
fn display_path(segments: &[Segment]) -> String {
    let mut s = String::new();
    for seg in segments {
        match seg {
            Segment::Key(k) => {
                if !s.is_empty() {
                    s.push('.');
                }
                s.push_str(k);
            }
            Segment::Index(i) => s.push_str(&format!("[{i}]")),
        }
    }
    s
}

fn unknown_field_error(segments: &[Segment]) -> FieldError {
    let path = display_path(segments);
    let Some((Segment::Key(field), parent)) = segments.split_last() else {
        return FieldError {
            path,
            message: "unknown field".into(),
        };
    };
    let known = known_fields(parent);
    let message = match suggestion(field, &known) {
        Some(s) => format!("unknown field (did you mean `{s}`?)"),
        None if known.is_empty() => "unknown field".to_string(),
        None => format!(
            "unknown field; expected one of {}",
            known
                .iter()
                .map(|k| format!("`{k}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    FieldError { path, message }
}

/// The CRD's schema, the one description of which fields exist where.
fn schema() -> &'static serde_json::Value {
    static SCHEMA: OnceLock<serde_json::Value> = OnceLock::new();
    SCHEMA.get_or_init(|| {
        let crd = serde_json::to_value(crate::crd()).unwrap_or_default();
        crd.pointer("/spec/versions/0/schema/openAPIV3Schema")
            .cloned()
            .unwrap_or_default()
    })
}

/// The field names the schema defines for the object at `parent` (empty when it defines none
/// or the path leaves the schema, e.g. inside `metadata`).
fn known_fields(parent: &[Segment]) -> Vec<String> {
    if parent.is_empty() {
        return ROOT_FIELDS.map(String::from).to_vec();
    }
    let mut node = schema();
    for seg in parent {
        let next = match seg {
            Segment::Key(k) => node
                .get("properties")
                .and_then(|p| p.get(k))
                .or_else(|| node.get("additionalProperties")),
            Segment::Index(_) => node.get("items"),
        };
        match next {
            Some(n) => node = n,
            None => return Vec::new(),
        }
    }
    node.get("properties")
        .and_then(|p| p.as_object())
        .map(|p| p.keys().cloned().collect())
        .unwrap_or_default()
}

/// The known field closest to `field`, if it is close enough to be the intended one.
fn suggestion<'a>(field: &str, known: &'a [String]) -> Option<&'a str> {
    let field_lower = field.to_ascii_lowercase();
    known
        .iter()
        .map(|k| (edit_distance(&field_lower, &k.to_ascii_lowercase()), k))
        .filter(|(d, k)| *d <= (field.len().min(k.len()) / 3).max(1))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k.as_str())
}

/// Optimal string alignment distance: insertions, deletions, substitutions and transpositions
/// of adjacent characters (`burts` → `burst` is one edit).
fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edit_distance_counts_transpositions_as_one() {
        assert_eq!(edit_distance("burts", "burst"), 1);
        assert_eq!(edit_distance("failurmode", "failuremode"), 1);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("same", "same"), 0);
    }

    #[test]
    fn suggests_only_close_names() {
        let known: Vec<String> = ["requests", "period", "burst", "algorithm", "maxDelay"]
            .map(String::from)
            .to_vec();
        assert_eq!(suggestion("burts", &known), Some("burst"));
        assert_eq!(suggestion("peroid", &known), Some("period"));
        assert_eq!(suggestion("maxdelay", &known), Some("maxDelay"));
        assert_eq!(suggestion("colour", &known), None);
        assert_eq!(suggestion("x", &known), None);
    }
}
