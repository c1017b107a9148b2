// Single-stream decode of a GGUF with llama.cpp, through node-llama-cpp's prebuilt binaries.
//
// Usage: node bench/peers/llama_cpp_node.mjs NODE_DIR '{"gguf": PATH, "prompt": [ids...],
//            "prompt_len": N, "output_len": M, "threads": T}'
// NODE_DIR: the folder made by bench/peers/install_llama_cpp_node.sh (its node_modules holds
// node-llama-cpp). Prints one JSON line: prefill_s (prompt to first token), decode_tok_s (the
// remaining M-1 tokens), and the llama.cpp build it ran.
//
// The same protocol as the llama-cpp-python child in bench/peers/single_stream.py: the prompt
// token ids as given, greedy (temperature 0), EOS ignored (yieldEogToken: generation goes on
// past an end-of-generation token), one unrecorded warm-up generation, then one measured
// generation, each from an empty context (clearHistory: no prefix reuse between the two).
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const [nodeDir, argJson] = process.argv.slice(2);
if (!nodeDir || !argJson) {
    console.error("usage: node llama_cpp_node.mjs NODE_DIR ARGS_JSON");
    process.exit(2);
}
const a = JSON.parse(argJson);
const entry = join(nodeDir, "node_modules", "node-llama-cpp", "dist", "index.js");
const { getLlama, LlamaLogLevel } = await import(pathToFileURL(entry).href);

// build "never": only the prebuilt binary, never a local compile (it fails loudly instead)
const llama = await getLlama({ gpu: false, build: "never", maxThreads: a.threads, logLevel: LlamaLogLevel.error });
const model = await llama.loadModel({ modelPath: a.gguf, gpuLayers: 0 });
const context = await model.createContext({
    contextSize: a.prompt_len + a.output_len + 8, batchSize: 512, sequences: 1,
    threads: { ideal: a.threads, min: a.threads },
});
const sequence = context.getSequence();

async function run() {
    await sequence.clearHistory();
    const times = [];
    const t0 = performance.now();
    for await (const _token of sequence.evaluate(a.prompt, { temperature: 0, yieldEogToken: true })) {
        times.push(performance.now());
        if (times.length === a.output_len) break;
    }
    return [(times[0] - t0) / 1000, (a.output_len - 1) / ((times[times.length - 1] - times[0]) / 1000)];
}

await run();
const [prefill_s, decode_tok_s] = await run();
const release = llama.llamaCppRelease;
console.log(JSON.stringify({
    prefill_s, decode_tok_s, threads: context.currentThreads,
    llama_cpp: `${release.repo}@${release.release}`, system_info: llama.systemInfo,
}));
await context.dispose();
await model.dispose();
await llama.dispose();
