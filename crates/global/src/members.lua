-- tollgate: sidecar membership per policy, kept alive by heartbeats.
-- KEYS[1]  sorted set of sidecar ids scored by the time their registration lapses
-- ARGV[1]  sidecar id
-- ARGV[2]  registration lifetime in milliseconds
-- ARGV[3]  1 = register / heartbeat, 0 = leave
-- returns the number of live sidecars
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if ARGV[3] == '1' then
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
else
  redis.call('ZREM', KEYS[1], ARGV[1])
end
redis.call('PEXPIRE', KEYS[1], ttl * 2)
return redis.call('ZCARD', KEYS[1])
