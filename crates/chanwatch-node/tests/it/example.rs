//! The `embed_node` example, run as a test: a person embedding a node with a handler of their
//! own follows it, so it must keep compiling and working (a node, a coordinator and three
//! channels on the embedded store; it asserts the handler ran all three).

#[path = "../../examples/embed_node.rs"]
mod embed_node;

#[test]
fn the_embed_node_example_runs_a_custom_handler_on_the_embedded_store() {
    if let Err(e) = embed_node::main() {
        panic!("the example failed: {e}");
    }
}
