//! Compiles `proto/shard/v1/shard.proto` into the gRPC client at build time; generated code is never edited.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path().expect("protoc-bin-vendored ships protoc for this platform");
    std::env::set_var("PROTOC", protoc);
    println!("cargo:rerun-if-changed=../proto/shard/v1/shard.proto");
    tonic_prost_build::configure()
        .build_server(false)
        .compile_protos(&["../proto/shard/v1/shard.proto"], &["../proto"])?;
    Ok(())
}
