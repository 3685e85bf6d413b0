use std::collections::BTreeMap;

use http::{HeaderValue, Request, Response};
use http_body_util::BodyExt;
use kube::client::Body;
use tower_test::mock;

use super::*;

fn headers(auth: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(
        http::header::AUTHORIZATION,
        HeaderValue::from_str(auth).unwrap(),
    );
    h
}

fn sa(ns: &str, pod: Option<&str>) -> Identity {
    Identity {
        username: format!("system:serviceaccount:{ns}:app"),
        namespace: Some(ns.to_string()),
        service_account: Some("app".to_string()),
        pod_name: pod.map(str::to_string),
        pod_uid: None,
    }
}

#[test]
fn bearer_tokens_are_parsed_strictly() {
    assert_eq!(bearer_token(&headers("Bearer abc.def")), Some("abc.def"));
    assert_eq!(bearer_token(&headers("bearer  abc ")), Some("abc"));
    assert_eq!(bearer_token(&headers("Basic abc")), None);
    assert_eq!(bearer_token(&headers("Bearer ")), None);
    assert_eq!(bearer_token(&HeaderMap::new()), None);
}

#[test]
fn scoping_requires_same_namespace_and_bound_pod() {
    assert!(authorize(&sa("shop", None), "shop", "api-1").is_ok());
    assert!(authorize(&sa("shop", Some("api-1")), "shop", "api-1").is_ok());
    let err = authorize(&sa("shop", None), "bank", "api-1").unwrap_err();
    assert!(err.contains("\"bank\""), "{err}");
    let err = authorize(&sa("shop", Some("api-2")), "shop", "api-1").unwrap_err();
    assert!(err.contains("api-2"), "{err}");
    let user = Identity {
        username: "alice".into(),
        namespace: None,
        service_account: None,
        pod_name: None,
        pod_uid: None,
    };
    assert!(authorize(&user, "shop", "api-1").is_err());
}

/// A StatefulSet re-creates `web-0` under a new UID: a still-cached review of the old pod's
/// token must not act for the new one. Unknown UIDs on either side are not a mismatch.
#[test]
fn tokens_of_an_earlier_pod_of_the_same_name_are_refused() {
    let bound = |uid: Option<&str>| Identity {
        pod_uid: uid.map(str::to_string),
        ..sa("shop", Some("web-0"))
    };
    assert!(same_incarnation(&bound(Some("uid-2")), Some("uid-2")).is_ok());
    let err = same_incarnation(&bound(Some("uid-1")), Some("uid-2")).unwrap_err();
    assert!(err.contains("uid-1") && err.contains("uid-2"), "{err}");
    assert!(same_incarnation(&bound(None), Some("uid-2")).is_ok());
    assert!(same_incarnation(&bound(Some("uid-1")), None).is_ok());
}

#[test]
fn identities_are_read_from_user_info() {
    let user = UserInfo {
        username: Some("system:serviceaccount:shop:api".into()),
        extra: Some(BTreeMap::from([
            (POD_NAME_EXTRA.to_string(), vec!["api-1".to_string()]),
            (POD_UID_EXTRA.to_string(), vec!["4f1c-uid".to_string()]),
        ])),
        ..UserInfo::default()
    };
    let id = identity_from_user(&user).unwrap();
    assert_eq!(id.namespace.as_deref(), Some("shop"));
    assert_eq!(id.service_account.as_deref(), Some("api"));
    assert_eq!(id.pod_name.as_deref(), Some("api-1"));
    assert_eq!(id.pod_uid.as_deref(), Some("4f1c-uid"));

    let id = identity_from_user(&UserInfo {
        username: Some("kubernetes-admin".into()),
        ..UserInfo::default()
    })
    .unwrap();
    assert_eq!(id.namespace, None);
    assert!(identity_from_user(&UserInfo::default()).is_err());
}

type Handle = mock::Handle<Request<Body>, Response<Body>>;

fn mock_client() -> (kube::Client, Handle) {
    let (svc, handle) = mock::pair::<Request<Body>, Response<Body>>();
    (kube::Client::new(svc, "default"), handle)
}

/// Answers one TokenReview like the API server would.
async fn answer_review(handle: &mut Handle, authenticated: bool) -> serde_json::Value {
    let (req, send) = tokio::time::timeout(Duration::from_secs(5), handle.next_request())
        .await
        .expect("a TokenReview request")
        .expect("service alive");
    assert_eq!(req.method(), http::Method::POST);
    assert_eq!(
        req.uri().path(),
        "/apis/authentication.k8s.io/v1/tokenreviews"
    );
    let body = req.into_body().collect().await.unwrap().to_bytes();
    let sent: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let mut reply = sent.clone();
    reply["status"] = if authenticated {
        serde_json::json!({
            "authenticated": true,
            "audiences": ["tollgate"],
            "user": {
                "username": "system:serviceaccount:shop:api",
                "uid": "u-1",
                "extra": {POD_NAME_EXTRA: ["api-1"]},
            }
        })
    } else {
        serde_json::json!({"authenticated": false, "error": "token expired"})
    };
    send.send_response(
        Response::builder()
            .status(201)
            .body(Body::from(serde_json::to_vec(&reply).unwrap()))
            .unwrap(),
    );
    sent
}

#[tokio::test]
async fn token_review_authenticates_and_caches() {
    let (client, mut handle) = mock_client();
    let auth = TokenReviewAuthenticator::new(client, vec!["tollgate".into()], DEFAULT_CACHE_TTL);
    let (id, sent) = tokio::join!(
        auth.authenticate("secret-token"),
        answer_review(&mut handle, true)
    );
    let id = id.unwrap();
    assert_eq!(sent["spec"]["token"], "secret-token");
    assert_eq!(sent["spec"]["audiences"], serde_json::json!(["tollgate"]));
    assert_eq!(id.namespace.as_deref(), Some("shop"));
    assert_eq!(id.pod_name.as_deref(), Some("api-1"));

    // Cached: no second request reaches the API.
    let again = auth.authenticate("secret-token").await.unwrap();
    assert_eq!(again, id);
    assert!(
        tokio::time::timeout(Duration::from_millis(100), handle.next_request())
            .await
            .is_err(),
        "a cached token must not be reviewed again"
    );
}

#[tokio::test]
async fn token_review_rejections_are_unauthenticated() {
    let (client, mut handle) = mock_client();
    let auth = TokenReviewAuthenticator::new(client, vec![], DEFAULT_CACHE_TTL);
    let (res, sent) = tokio::join!(
        auth.authenticate("stale"),
        answer_review(&mut handle, false)
    );
    assert!(sent["spec"].get("audiences").is_none());
    assert_eq!(res, Err(AuthError::Unauthenticated("token expired".into())));
}

#[tokio::test]
async fn token_review_api_errors_are_unavailable() {
    let (client, mut handle) = mock_client();
    let auth = TokenReviewAuthenticator::new(client, vec![], DEFAULT_CACHE_TTL);
    let answer = async {
        let (_req, send) = handle.next_request().await.unwrap();
        send.send_response(
            Response::builder()
                .status(500)
                .body(Body::from(
                    br#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"boom","reason":"InternalError","code":500}"#
                        .to_vec(),
                ))
                .unwrap(),
        );
    };
    let (res, ()) = tokio::join!(auth.authenticate("tok"), answer);
    assert!(matches!(res, Err(AuthError::Unavailable(_))), "{res:?}");
}

/// Answers one TokenReview with `status`, returning what was sent.
async fn answer_with(handle: &mut Handle, status: serde_json::Value) -> serde_json::Value {
    let (req, send) = tokio::time::timeout(Duration::from_secs(5), handle.next_request())
        .await
        .expect("a TokenReview request")
        .expect("service alive");
    let body = req.into_body().collect().await.unwrap().to_bytes();
    let sent: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let mut reply = sent.clone();
    reply["status"] = status;
    send.send_response(
        Response::builder()
            .status(201)
            .body(Body::from(serde_json::to_vec(&reply).unwrap()))
            .unwrap(),
    );
    sent
}

/// What the API server answers for a token signed by a key it does not know, and for a token
/// whose `exp` has passed (tests/e2e/tests/security.rs sends both to a real API server).
#[tokio::test]
async fn forged_and_expired_tokens_are_rejected_and_not_retried_at_once() {
    let (client, mut handle) = mock_client();
    let auth = TokenReviewAuthenticator::new(client, vec!["tollgate".into()], DEFAULT_CACHE_TTL);
    for (token, error) in [
        (
            "forged.jwt.sig",
            "[invalid bearer token, square/go-jose: error in cryptographic primitive]",
        ),
        (
            "expired.jwt.sig",
            "[invalid bearer token, service account token has expired]",
        ),
    ] {
        let (res, sent) = tokio::join!(
            auth.authenticate(token),
            answer_with(
                &mut handle,
                serde_json::json!({"authenticated": false, "error": error})
            )
        );
        assert_eq!(sent["spec"]["token"], token);
        match res {
            Err(AuthError::Unauthenticated(why)) => assert_eq!(why, error),
            other => panic!("{token}: {other:?}"),
        }
        // Remembered briefly: a sidecar retrying a bad token does not cost a review each time.
        assert!(matches!(
            auth.authenticate(token).await,
            Err(AuthError::Unauthenticated(_))
        ));
        assert!(
            tokio::time::timeout(Duration::from_millis(100), handle.next_request())
                .await
                .is_err(),
            "a rejected token is not reviewed again at once"
        );
    }
}

/// The audience is checked here too, not only by the API server: a token the API server
/// accepts for another audience (e.g. one meant for a different service) is refused.
#[tokio::test]
async fn tokens_for_another_audience_are_rejected() {
    let (client, mut handle) = mock_client();
    let auth = TokenReviewAuthenticator::new(client, vec!["tollgate".into()], DEFAULT_CACHE_TTL);
    let (res, _) = tokio::join!(
        auth.authenticate("other-audience"),
        answer_with(
            &mut handle,
            serde_json::json!({
                "authenticated": true,
                "audiences": ["vault"],
                "user": {"username": "system:serviceaccount:shop:api"}
            })
        )
    );
    match res {
        Err(AuthError::Unauthenticated(why)) => assert!(why.contains("audience"), "{why}"),
        other => panic!("{other:?}"),
    }
}

/// A valid token of a user that is not a service account (a person's token, a node) may not
/// stream rules for any pod.
#[tokio::test]
async fn authenticated_non_service_accounts_are_not_sidecars() {
    let (client, mut handle) = mock_client();
    let auth = TokenReviewAuthenticator::new(client, vec![], DEFAULT_CACHE_TTL);
    let (res, _) = tokio::join!(
        auth.authenticate("node-token"),
        answer_with(
            &mut handle,
            serde_json::json!({
                "authenticated": true,
                "user": {"username": "system:node:worker-1", "groups": ["system:nodes"]}
            })
        )
    );
    let id = res.unwrap();
    assert_eq!(id.namespace, None);
    let err = authorize(&id, "shop", "api-1").unwrap_err();
    assert!(err.contains("not a service account"), "{err}");
}
