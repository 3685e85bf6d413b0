//! The compile function on valid and malformed policies: every error names its field.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]

use tollgate_crd::compiled::*;
use tollgate_crd::{compile, parse_yaml, parse_yaml_documents};

const HEADER: &str = "apiVersion: tollgate.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: p, namespace: ns}\n";

fn spec(body: &str) -> String {
    format!("{HEADER}spec:\n  targetRef: {{selector: {{matchLabels: {{app: a}}}}}}\n{body}")
}

fn rule(body: &str) -> String {
    spec(&format!("  rules:\n  - name: r\n{body}"))
}

/// Decodes and compiles `yaml` as the sidecar's files are (unknown fields are errors) and
/// returns every error as `path: message`.
fn errors(yaml: &str) -> Vec<String> {
    match parse_yaml_documents(yaml) {
        Err(e) => e.errors().iter().map(ToString::to_string).collect(),
        Ok(docs) => {
            assert_eq!(docs.len(), 1, "{yaml}");
            match docs[0].compile() {
                Ok(c) => panic!("expected errors, compiled to {c:?}\n{yaml}"),
                Err(e) => e.0.iter().map(ToString::to_string).collect(),
            }
        }
    }
}

fn assert_error(yaml: &str, path: &str, needle: &str) {
    let errs = errors(yaml);
    assert!(
        errs.iter()
            .any(|e| e.starts_with(&format!("{path}:")) && e.contains(needle)),
        "expected an error at {path} containing {needle:?}, got {errs:#?}"
    );
}

#[test]
fn every_example_policy_compiles() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../manifests/examples");
    let mut seen = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        for policy in parse_yaml(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display())) {
            compile(&policy).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            seen += 1;
        }
    }
    assert!(
        seen >= 4,
        "expected at least four example policies, found {seen}"
    );
}

#[test]
fn compiles_the_design_example_with_defaults_resolved() {
    let yaml = spec(
        r#"  failureMode: Open
  rules:
  - name: payments-per-key
    match:
      methods: [POST, POST]
      path: {prefix: /payments/}
      headers: [{name: X-Plan, value: free}]
    key:
    - header: X-API-Key
    - clientIP: {trustedHops: 1}
    limit: {requests: 100, period: 1m, burst: 20, algorithm: TokenBucket}
    cost: {header: x-cost, max: 10}
    failureMode: Closed
  - name: shadow
    limit: {requests: 5, period: 1s, algorithm: SlidingWindow}
    mode: Shadow
  bypass: {keys: [internal-batch], cidrs: [10.0.0.0/8]}
"#,
    );
    let p = compile(&parse_yaml(&yaml).unwrap()[0]).unwrap();
    assert_eq!(p.id(), "ns/p");
    let r = &p.rules[0];
    assert_eq!(r.id, "ns/p/payments-per-key");
    assert_eq!(r.matches.methods, vec![Method::POST]);
    assert_eq!(
        r.matches.path,
        Some(PathCondition::Prefix("/payments".into()))
    );
    assert_eq!(r.matches.headers[0].name, "x-plan");
    assert_eq!(
        r.key,
        vec![
            KeySource::Header("x-api-key".into()),
            KeySource::ClientIp { trusted_hops: 1 }
        ]
    );
    assert_eq!(
        r.limit,
        CompiledLimit {
            algorithm: Algorithm::TokenBucket,
            requests: 100,
            period_ms: 60_000,
            burst: 20,
            max_delay_ms: 0,
            block_for_ms: 0,
        }
    );
    assert_eq!(r.cost.header.as_deref(), Some("x-cost"));
    assert_eq!((r.cost.amount, r.cost.max), (1, 10));
    assert_eq!(r.failure_mode, FailureMode::Closed);
    assert_eq!(r.scope, Scope::Global);
    let s = &p.rules[1];
    assert_eq!(s.failure_mode, FailureMode::Open, "policy default applies");
    assert_eq!(s.limit.burst, 5, "burst defaults to requests");
    assert_eq!(s.mode, Mode::Shadow);
    assert_eq!(p.bypass.cidrs.len(), 1);

    // The wire format round-trips.
    let json = serde_json::to_string(&p).unwrap();
    let back: CompiledPolicy = serde_json::from_str(&json).unwrap();
    assert_eq!(back, p);
}

#[test]
fn describe_says_what_a_rule_does() {
    let yaml = rule(
        "    match: {methods: [POST], path: {prefix: /payments}}\n    key: [{header: x-api-key}]\n    limit: {requests: 10, period: 1m, burst: 5}\n    failureMode: Closed\n",
    );
    let p = compile(&parse_yaml(&yaml).unwrap()[0]).unwrap();
    let d = p.rules[0].describe();
    assert_eq!(
        p.rules[0].accuracy,
        tollgate_crd::policy::Accuracy::Auto,
        "the default"
    );
    assert_eq!(
        d,
        "r: POST requests under /payments: 10 requests per 1m (token bucket, bursts up to 5), per header x-api-key; shared by all sidecars (leased from Redis while one sidecar enforces it; with more, a share of the 5 tokens is under 5 and each request makes one Redis call); rejects excess with 429; if Redis is unreachable: rejects; requests missing a key part share one bucket"
    );
}

// ---- malformed policies: each asserts the field path in the message ----

#[test]
fn missing_rules() {
    assert_error(&spec("  rules: []\n"), "spec.rules", "at least one rule");
}

#[test]
fn duplicate_rule_names() {
    let yaml = spec(
        "  rules:\n  - {name: a, limit: {requests: 1, period: 1s}}\n  - {name: a, limit: {requests: 2, period: 1s}}\n",
    );
    assert_error(&yaml, "spec.rules[1].name", "duplicate rule name");
}

#[test]
fn bad_rule_name() {
    let yaml = spec("  rules:\n  - {name: Payments_Rule, limit: {requests: 1, period: 1s}}\n");
    assert_error(&yaml, "spec.rules[0].name", "lowercase");
}

#[test]
fn period_that_does_not_parse() {
    assert_error(
        &rule("    limit: {requests: 1, period: 1 minute}\n"),
        "spec.rules[0].limit.period",
        "unit",
    );
}

#[test]
fn period_in_days_is_refused() {
    assert_error(
        &rule("    limit: {requests: 1, period: 2d}\n"),
        "spec.rules[0].limit.period",
        "use ms, s, m or h",
    );
}

#[test]
fn zero_period() {
    assert_error(
        &rule("    limit: {requests: 1, period: 0s}\n"),
        "spec.rules[0].limit.period",
        "greater than 0",
    );
}

#[test]
fn period_over_a_day() {
    assert_error(
        &rule("    limit: {requests: 1, period: 25h}\n"),
        "spec.rules[0].limit.period",
        "longer than 24h",
    );
}

#[test]
fn missing_period() {
    assert_error(
        &rule("    limit: {requests: 1}\n"),
        "spec.rules[0].limit.period",
        "required",
    );
}

#[test]
fn zero_requests() {
    assert_error(
        &rule("    limit: {requests: 0, period: 1s}\n"),
        "spec.rules[0].limit.requests",
        "between 1 and",
    );
}

#[test]
fn burst_on_a_window_algorithm() {
    assert_error(
        &rule("    limit: {requests: 1, period: 1s, burst: 5, algorithm: FixedWindow}\n"),
        "spec.rules[0].limit.burst",
        "only applies to algorithm TokenBucket",
    );
}

#[test]
fn unknown_algorithm_names_the_field() {
    assert_error(
        &rule("    limit: {requests: 1, period: 1s, algorithm: Magic}\n"),
        "spec.rules[0].limit.algorithm",
        "unknown variant",
    );
}

#[test]
fn missing_limit_names_the_field() {
    assert_error(
        &rule("    mode: Shadow\n"),
        "spec.rules[0].limit",
        "Required value",
    );
}

/// A misspelled required field is both unknown and missing: the misspelling, with its
/// suggestion, comes first, because it is what the user has to fix.
#[test]
fn misspelled_required_field_names_the_misspelling_and_suggests_the_field() {
    for (yaml, typo) in [
        (
            rule("    limt: {requests: 1, period: 1s}\n"),
            "spec.rules[0].limt: unknown field (did you mean `limit`?)",
        ),
        (
            rule("    limit: {reqests: 1, period: 1s}\n"),
            "spec.rules[0].limit.reqests: unknown field (did you mean `requests`?)",
        ),
        (
            spec("  rulse:\n  - name: r\n    limit: {requests: 1, period: 1s}\n"),
            "spec.rulse: unknown field (did you mean `rules`?)",
        ),
    ] {
        let errs = errors(&yaml);
        assert_eq!(errs.first().map(String::as_str), Some(typo), "{errs:#?}");
        assert!(
            errs.iter().any(|e| e.ends_with(": Required value")),
            "{errs:#?}"
        );
    }
    // The admission webhook's entry point says the same.
    let value: serde_json::Value =
        serde_norway::from_str(&rule("    limt: {requests: 1, period: 1s}\n")).unwrap();
    let err = tollgate_crd::decode::from_json(value).unwrap_err();
    assert_eq!(
        err.to_string(),
        "spec.rules[0].limt: unknown field (did you mean `limit`?); \
         spec.rules[0].limit: Required value"
    );
}

/// The API server checks `required` before admission webhooks run and cannot see preserved
/// unknown fields, so the schema leaves required fields to admission: only the rules' list-map
/// key (`name`, which the API server needs to merge the list) stays required under `spec`.
#[test]
fn the_schema_leaves_required_fields_to_admission() {
    let crd = serde_json::to_value(tollgate_crd::crd()).unwrap();
    let spec = crd
        .pointer("/spec/versions/0/schema/openAPIV3Schema/properties/spec")
        .unwrap();
    let mut required = Vec::new();
    collect_required(spec, "spec", &mut required);
    assert_eq!(required, ["spec.rules[].name"]);
}

fn collect_required(node: &serde_json::Value, path: &str, out: &mut Vec<String>) {
    for field in node["required"].as_array().into_iter().flatten() {
        out.push(format!("{path}.{}", field.as_str().unwrap()));
    }
    for (k, child) in node["properties"].as_object().into_iter().flatten() {
        collect_required(child, &format!("{path}.{k}"), out);
    }
    if node.get("items").is_some() {
        collect_required(&node["items"], &format!("{path}[]"), out);
    }
}

#[test]
fn sliding_log_over_its_memory_bound() {
    assert_error(
        &rule(
            "    limit: {requests: 20000, period: 1m, algorithm: SlidingLog}\n    scope: Local\n",
        ),
        "spec.rules[0].limit.requests",
        "at most 10000",
    );
}

#[test]
fn max_delay_on_token_bucket() {
    assert_error(
        &rule("    limit: {requests: 1, period: 1s, maxDelay: 1s}\n"),
        "spec.rules[0].limit.maxDelay",
        "only applies to algorithm LeakyBucket",
    );
}

#[test]
fn concurrency_must_be_local() {
    assert_error(
        &rule("    limit: {requests: 10, algorithm: Concurrency}\n"),
        "spec.rules[0].scope",
        "set scope: Local",
    );
}

#[test]
fn concurrency_has_no_period() {
    assert_error(
        &rule("    limit: {requests: 10, period: 1s, algorithm: Concurrency}\n    scope: Local\n"),
        "spec.rules[0].limit.period",
        "does not apply to Concurrency",
    );
}

#[test]
fn strict_needs_global() {
    assert_error(
        &rule("    limit: {requests: 1, period: 1s}\n    scope: Local\n    accuracy: Strict\n"),
        "spec.rules[0].accuracy",
        "Strict needs scope: Global",
    );
}

#[test]
fn path_with_two_kinds() {
    assert_error(
        &rule("    match: {path: {exact: /a, prefix: /b}}\n    limit: {requests: 1, period: 1s}\n"),
        "spec.rules[0].match.path",
        "exactly one of exact, prefix or regex",
    );
}

#[test]
fn path_without_leading_slash() {
    assert_error(
        &rule("    match: {path: {prefix: payments}}\n    limit: {requests: 1, period: 1s}\n"),
        "spec.rules[0].match.path.prefix",
        "must start with '/'",
    );
}

#[test]
fn path_regex_that_does_not_compile() {
    assert_error(
        &rule("    match: {path: {regex: '/users/(\\d+'}}\n    limit: {requests: 1, period: 1s}\n"),
        "spec.rules[0].match.path.regex",
        "not a valid regular expression",
    );
}

#[test]
fn path_regex_with_lookahead() {
    assert_error(
        &rule("    match: {path: {regex: '/(?!admin).*'}}\n    limit: {requests: 1, period: 1s}\n"),
        "spec.rules[0].match.path.regex",
        "not a valid regular expression",
    );
}

#[test]
fn header_regex_that_does_not_compile() {
    assert_error(
        &rule(
            "    match: {headers: [{name: x-plan, regex: '[a-'}]}\n    limit: {requests: 1, period: 1s}\n",
        ),
        "spec.rules[0].match.headers[0].regex",
        "not a valid regular expression",
    );
}

#[test]
fn header_with_value_and_regex() {
    assert_error(
        &rule(
            "    match: {headers: [{name: x-plan, value: a, regex: b}]}\n    limit: {requests: 1, period: 1s}\n",
        ),
        "spec.rules[0].match.headers[0]",
        "at most one of value or regex",
    );
}

#[test]
fn header_name_with_spaces() {
    assert_error(
        &rule("    key: [{header: 'x api key'}]\n    limit: {requests: 1, period: 1s}\n"),
        "spec.rules[0].key[0].header",
        "not a valid HTTP header name",
    );
}

#[test]
fn key_part_with_two_sources() {
    assert_error(
        &rule("    key: [{header: x-a, constant: b}]\n    limit: {requests: 1, period: 1s}\n"),
        "spec.rules[0].key[0]",
        "exactly one of header, clientIP",
    );
}

#[test]
fn empty_key_part() {
    assert_error(
        &rule("    key: [{}]\n    limit: {requests: 1, period: 1s}\n"),
        "spec.rules[0].key[0]",
        "exactly one of",
    );
}

#[test]
fn too_many_trusted_hops() {
    assert_error(
        &rule("    key: [{clientIP: {trustedHops: 40}}]\n    limit: {requests: 1, period: 1s}\n"),
        "spec.rules[0].key[0].clientIP.trustedHops",
        "at most 16",
    );
}

#[test]
fn jwt_claim_with_empty_segment() {
    assert_error(
        &rule("    key: [{jwtClaim: {claim: 'org..id'}}]\n    limit: {requests: 1, period: 1s}\n"),
        "spec.rules[0].key[0].jwtClaim.claim",
        "claim name",
    );
}

#[test]
fn cost_above_its_max() {
    assert_error(
        &rule("    limit: {requests: 10, period: 1s}\n    cost: {amount: 50, max: 10}\n"),
        "spec.rules[0].cost.amount",
        "must not exceed cost.max",
    );
}

#[test]
fn bypass_address_without_prefix() {
    assert_error(
        &spec(
            "  rules: [{name: r, limit: {requests: 1, period: 1s}}]\n  bypass: {cidrs: [10.0.0.1]}\n",
        ),
        "spec.bypass.cidrs[0]",
        "needs a prefix length",
    );
}

#[test]
fn bad_selector_operator() {
    let yaml = format!(
        "{HEADER}spec:\n  targetRef: {{selector: {{matchExpressions: [{{key: app, operator: Equals, values: [a]}}]}}}}\n  rules: [{{name: r, limit: {{requests: 1, period: 1s}}}}]\n"
    );
    assert_error(
        &yaml,
        "spec.targetRef.selector.matchExpressions[0].operator",
        "unknown operator",
    );
}

#[test]
fn wrong_kind_is_refused() {
    let errs = errors("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n");
    assert!(errs[0].starts_with("document 0.kind:"), "{errs:?}");
}

#[test]
fn all_errors_are_reported_at_once() {
    let yaml = spec(
        "  rules:\n  - {name: a, limit: {requests: 0, period: 1x}}\n  - {name: a, limit: {requests: 1, period: 1s, burst: 0}}\n",
    );
    let errs = errors(&yaml);
    assert!(errs.len() >= 4, "{errs:#?}");
}

#[test]
fn selector_semantics() {
    use std::collections::BTreeMap;
    let sel = Selector {
        match_labels: BTreeMap::from([("app".into(), "a".into())]),
        match_expressions: vec![SelectorRequirement {
            key: "tier".into(),
            operator: SelectorOperator::NotIn,
            values: vec!["canary".into()],
        }],
    };
    let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    assert!(sel.matches(&labels(&[("app", "a")])));
    assert!(sel.matches(&labels(&[("app", "a"), ("tier", "web")])));
    assert!(!sel.matches(&labels(&[("app", "a"), ("tier", "canary")])));
    assert!(!sel.matches(&labels(&[("app", "b")])));
    assert!(Selector::default().matches(&labels(&[])));
}

#[test]
fn header_value_with_control_characters() {
    // Found by fuzzing: such a value compiled, then every sidecar refused the rule set.
    assert_error(
        &rule(
            "    match: {headers: [{name: x-plan, value: \"a\\u0001b\"}]}\n    limit: {requests: 1, period: 1s}\n",
        ),
        "spec.rules[0].match.headers[0].value",
        "control characters",
    );
}

#[test]
fn unknown_fields_are_refused_with_their_path_and_a_suggestion() {
    // Each typo decoded to a valid policy that was not the one written (no burst, Open, ...).
    let yaml = spec(
        r#"  failurMode: Closed
  rules:
  - name: r
    limit: {requests: 5, period: 1s, burts: 5}
    failureMode: Closed
  - name: s
    match: {path: {prefix: /a}, header: [{name: x}]}
    key: [{clientIP: {trustedHop: 1}}, {endpoint: {any: 1}}]
    limit: {requests: 5, period: 1s}
    scope: Local
    colour: blue
  bypass: {cidrs: [10.0.0.0/8], trustedHops: 1, key: [k]}
"#,
    );
    let errs = errors(&yaml);
    let expected = [
        "spec.failurMode: unknown field (did you mean `failureMode`?)",
        "spec.rules[0].limit.burts: unknown field (did you mean `burst`?)",
        "spec.rules[1].match.header: unknown field (did you mean `headers`?)",
        "spec.rules[1].key[0].clientIP.trustedHop: unknown field (did you mean `trustedHops`?)",
        "spec.rules[1].key[1].endpoint.any: unknown field",
        "spec.bypass.key: unknown field (did you mean `keys`?)",
    ];
    for e in expected {
        assert!(
            errs.iter().any(|got| got == e),
            "missing {e:?} in {errs:#?}"
        );
    }
    // No close name: the known ones are listed.
    assert!(
        errs.iter().any(
            |e| e.starts_with("spec.rules[1].colour: unknown field; expected one of")
                && e.contains("`limit`")
        ),
        "{errs:#?}"
    );
    assert_eq!(errs.len(), expected.len() + 1, "{errs:#?}");

    // Reported together with compile errors, so one run shows everything.
    let both = errors(&rule("    limit: {requests: 0, period: 1s, burts: 5}\n"));
    assert_eq!(
        both,
        [
            "spec.rules[0].limit.burts: unknown field (did you mean `burst`?)",
            "spec.rules[0].limit.requests: 0 must be between 1 and 1000000000",
        ],
        "{both:#?}"
    );

    // The strict parser refuses them too; typos in metadata and the selector are caught as well.
    let err = parse_yaml(
        "apiVersion: tollgate.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: p, namespce: ns}\nspec:\n  targetRef: {selector: {matchLabel: {app: a}}}\n  rules: [{name: r, limit: {requests: 1, period: 1s}}]\n",
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("metadata.namespce: unknown field"), "{err}");
    assert!(
        err.contains(
            "spec.targetRef.selector.matchLabel: unknown field (did you mean `matchLabels`?)"
        ),
        "{err}"
    );

    // Status stays lenient: a newer controller may have written fields this one lacks.
    let with_status = format!(
        "{}status: {{ruleCount: 1, futureField: x}}\n",
        rule("    limit: {requests: 1, period: 1s}\n")
    );
    let docs = parse_yaml_documents(&with_status).unwrap();
    assert!(
        docs[0].unknown_fields.is_empty(),
        "{:?}",
        docs[0].unknown_fields
    );
    assert!(docs[0].compile().is_ok());
}

#[test]
fn the_webhook_json_path_collects_unknown_fields_too() {
    let value = serde_json::json!({
        "apiVersion": "tollgate.dev/v1alpha1", "kind": "RateLimitPolicy",
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"targetRef": {"selector": {}}, "rules": [
            {"name": "r", "limit": {"requests": 1, "period": "1s", "burts": 5}}
        ]}
    });
    let decoded = tollgate_crd::decode::from_json(value).unwrap();
    let errs: Vec<String> = decoded
        .unknown_fields
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        errs,
        ["spec.rules[0].limit.burts: unknown field (did you mean `burst`?)"]
    );
    // Decoding stays lenient: the rest of the policy is there.
    assert_eq!(decoded.policy.spec.rules[0].limit.requests, 1);
}

#[test]
fn descriptor_rules_compile_and_say_what_they_decide() {
    let yaml = rule(
        "    match: {descriptors: [{key: route, value: checkout}, {key: api_key}]}\n    key: [{descriptor: api_key}]\n    limit: {requests: 5, period: 1s}\n",
    );
    let docs = parse_yaml_documents(&yaml).unwrap();
    let compiled = docs[0].compile().unwrap();
    let r = &compiled.rules[0];
    assert!(r.for_descriptors());
    assert_eq!(r.key, vec![KeySource::Descriptor("api_key".into())]);
    assert_eq!(
        r.matches.descriptors,
        vec![
            DescriptorCondition {
                key: "route".into(),
                value: Some("checkout".into())
            },
            DescriptorCondition {
                key: "api_key".into(),
                value: None
            },
        ]
    );
    let said = r.describe();
    assert!(
        said.starts_with(
            "r: rate limit service descriptors with route=checkout, api_key: 5 requests per 1s"
        ) && said.contains("per descriptor entry api_key")
            && said.contains("refused by Envoy")
            && !said.contains("sidecar"),
        "{said}"
    );
    // A key part alone makes a descriptor rule too; a constant fits either kind.
    let yaml = rule(
        "    key: [{descriptor: tenant}, {constant: gold}]\n    limit: {requests: 5, period: 1s}\n",
    );
    let r = &parse_yaml_documents(&yaml).unwrap()[0]
        .compile()
        .unwrap()
        .rules[0];
    assert!(r.for_descriptors());
    let said = r.describe();
    assert!(
        said.starts_with("r: rate limit service descriptors: ")
            && said.contains("per descriptor entry tenant + constant \"gold\""),
        "{said}"
    );
    // An HTTP rule is not one.
    let yaml = rule("    key: [{header: x-api-key}]\n    limit: {requests: 5, period: 1s}\n");
    assert!(
        !parse_yaml_documents(&yaml).unwrap()[0]
            .compile()
            .unwrap()
            .rules[0]
            .for_descriptors()
    );
}

#[test]
fn a_rule_is_for_http_requests_or_for_descriptors_not_both() {
    for (body, path) in [
        (
            "    match: {descriptors: [{key: route}], path: {prefix: /api}}\n    limit: {requests: 5, period: 1s}\n",
            "spec.rules[0].match.path",
        ),
        (
            "    match: {methods: [GET]}\n    key: [{descriptor: api_key}]\n    limit: {requests: 5, period: 1s}\n",
            "spec.rules[0].match.methods",
        ),
        (
            "    key: [{descriptor: api_key}, {header: x-user}]\n    limit: {requests: 5, period: 1s}\n",
            "spec.rules[0].key[1]",
        ),
        (
            "    key: [{descriptor: api_key}]\n    cost: {header: x-cost}\n    limit: {requests: 5, period: 1s}\n",
            "spec.rules[0].cost",
        ),
    ] {
        assert_error(&rule(body), path, "rate limit service descriptors");
    }
    assert_error(
        &rule("    key: [{descriptor: \"\"}]\n    limit: {requests: 5, period: 1s}\n"),
        "spec.rules[0].key[0].descriptor",
        "must not be empty",
    );
    assert_error(
        &rule("    key: [{descriptor: a, header: b}]\n    limit: {requests: 5, period: 1s}\n"),
        "spec.rules[0].key[0]",
        "or descriptor",
    );
}
