-- wrk script for benchmarks/router_bench.py: POST a JSON body read from a file,
-- and print one JSON line of results (latency percentiles in microseconds).
--
--   wrk -t1 -c32 -d5s --timeout 10s -s benchmarks/wrk/post_json.lua URL -- BODY_FILE
--
-- The body file holds the whole request body (~1 KB of JSON). Every request is
-- the same; wrk measures each one from the write of its request to the end of
-- its response (for a streamed answer: the last chunk).

function init(args)
   local f = assert(io.open(args[1], "rb"))
   wrk.body = f:read("*a")
   f:close()
   wrk.method = "POST"
   wrk.headers["Content-Type"] = "application/json"
end

function done(summary, latency, requests)
   local e = summary.errors
   io.write(string.format(
      'ROUTER_BENCH {"requests": %d, "duration_us": %d, "bytes": %d, ' ..
      '"errors": {"connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d}, ' ..
      '"latency_us": {"mean": %.1f, "p50": %d, "p90": %d, "p99": %d, "p999": %d, "max": %d}}\n',
      summary.requests, summary.duration, summary.bytes,
      e.connect, e.read, e.write, e.status, e.timeout,
      latency.mean, latency:percentile(50.0), latency:percentile(90.0),
      latency:percentile(99.0), latency:percentile(99.9), latency.max))
end
