-- wrk script for benchmarks/router_bench.py's long-prompt scenarios: every
-- request is a different body, built from a few shared beginnings and a
-- unique end, and one JSON line of results is printed as post_json.lua does.
--
--   wrk -t1 -c32 -d5s --timeout 10s -s benchmarks/wrk/post_prompts.lua URL -- SPEC_FILE FIRST_NUMBER
--
-- The spec file has one item per line, its kind first:
--   P <path>    the request path (/v1/completions or /v1/chat/completions)
--   H <text>    a shared beginning of the body (several: taken in turn)
--   T <text>    the rest of the prompt after the request's number
--   E <text>    the end of the body after the prompt
-- Request n's body is H[n mod #H] .. n .. T .. E, so requests share their
-- beginnings (a prefix cache hits on them) and differ from the number on
-- (what follows it is new to every cache). FIRST_NUMBER keeps numbers
-- distinct across wrk runs against the same router.

function init(args)
   local f = assert(io.open(args[1], "rb"))
   heads = {}
   for line in f:lines() do
      local kind, text = line:sub(1, 1), line:sub(3)
      if kind == "P" then
         path = text
      elseif kind == "H" then
         heads[#heads + 1] = text
      elseif kind == "T" then
         tail = text
      elseif kind == "E" then
         ending = text
      end
   end
   f:close()
   counter = tonumber(args[2]) or 0
   headers = {["Content-Type"] = "application/json"}
end

function request()
   counter = counter + 1
   local body = heads[(counter % #heads) + 1] .. counter .. tail .. ending
   return wrk.format("POST", path, headers, body)
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
