//! [`GrpcProxy`] against a real etcd: watches see events through it; while watches are
//! stalled they see nothing but puts and lease keepalives through the same proxy (the same
//! HTTP/2 connection) succeed; after the release the held events arrive in order.

use std::time::Duration;

use chanwatch_testkit::{EtcdFixture, GrpcProxy};
use etcd_client::{Client, EventType, WatchOptions, WatchStream};

/// The next put event's value, or None if none comes within `wait`.
async fn next_put(stream: &mut WatchStream, wait: Duration) -> Option<String> {
    loop {
        let resp = match tokio::time::timeout(wait, stream.message()).await {
            Ok(Ok(Some(r))) => r,
            Ok(Ok(None)) => panic!("watch stream ended"),
            Ok(Err(e)) => panic!("watch stream failed: {e}"),
            Err(_) => return None,
        };
        if let Some(ev) = resp
            .events()
            .iter()
            .find(|e| e.event_type() == EventType::Put)
        {
            let kv = ev.kv().expect("a put has its key-value");
            return Some(kv.value_str().expect("utf-8").to_owned());
        }
    }
}

#[tokio::test]
async fn a_stalled_proxy_holds_watch_events_while_puts_and_keepalives_pass() {
    let etcd = EtcdFixture::start().await.expect("etcd fixture");
    let proxy = GrpcProxy::start(etcd.endpoint()).await.expect("proxy");
    let mut client = Client::connect([proxy.endpoint()], None)
        .await
        .expect("connect through the proxy");
    let mut stream = client
        .watch("k/", Some(WatchOptions::new().with_prefix()))
        .await
        .expect("watch through the proxy");
    assert_eq!(proxy.watch_calls(), 1, "the watch went through the proxy");

    client.put("k/1", "one", None).await.expect("put");
    assert_eq!(
        next_put(&mut stream, Duration::from_secs(5))
            .await
            .as_deref(),
        Some("one"),
        "a watch through the proxy sees events"
    );

    proxy.stall_watches();
    let lease = client.lease_grant(4, None).await.expect("lease grant");
    let (mut keeper, mut acks) = client
        .lease_keep_alive(lease.id())
        .await
        .expect("keepalive stream");
    for (i, value) in ["two", "three"].into_iter().enumerate() {
        client
            .put(format!("k/{}", i + 2), value, None)
            .await
            .expect("a put through the proxy passes while watches are stalled");
        keeper.keep_alive().await.expect("keepalive request");
        let ack = tokio::time::timeout(Duration::from_secs(2), acks.message())
            .await
            .expect("a keepalive through the proxy is answered while watches are stalled")
            .expect("keepalive answer")
            .expect("keepalive stream open");
        assert!(ack.ttl() > 0, "the lease is alive");
    }
    let got = client.get("k/3", None).await.expect("range");
    assert_eq!(
        got.kvs().len(),
        1,
        "a range passes while watches are stalled"
    );
    assert_eq!(
        next_put(&mut stream, Duration::from_millis(1500)).await,
        None,
        "a stalled watch sees no event"
    );

    proxy.release_watches();
    assert_eq!(
        next_put(&mut stream, Duration::from_secs(5))
            .await
            .as_deref(),
        Some("two"),
        "held events arrive after the release"
    );
    assert_eq!(
        next_put(&mut stream, Duration::from_secs(5))
            .await
            .as_deref(),
        Some("three"),
        "in order"
    );
}
