import assert from "node:assert/strict";
import { test } from "node:test";
import {
  defaultLocateEnv,
  type LocateEnv,
  locateCudaInclude,
  locateLibcuda,
  locateLibnvrtc,
  locateNvcc,
} from "../../src/cuda/locate.js";

/** A pretend machine: `files` exist, nothing else does. Counts python3 site lookups. */
function fakeEnv(
  files: string[],
  env: NodeJS.ProcessEnv = {},
  sites: string[] = [],
): LocateEnv & { siteCalls: number } {
  const set = new Set(files);
  const le = {
    env,
    fileExists: (f: string) => set.has(f),
    sitePackages: () => {
      le.siteCalls++;
      return sites;
    },
    versionedCudaRoots: () => ["/usr/local/cuda-13.0", "/usr/local/cuda-12.8"],
    siteCalls: 0,
  };
  return le;
}

test("an explicit MEGAMOE_LIBCUDA naming a missing file fails with a reason (real environment)", () => {
  const saved = process.env.MEGAMOE_LIBCUDA;
  process.env.MEGAMOE_LIBCUDA = "/nonexistent/megamoe/libcuda.so.1";
  try {
    const r = locateLibcuda();
    assert.equal(r.ok, false);
    if (!r.ok)
      assert.match(
        r.reason,
        /MEGAMOE_LIBCUDA=\/nonexistent\/megamoe\/libcuda\.so\.1 does not name an existing file/,
      );
  } finally {
    if (saved === undefined) delete process.env.MEGAMOE_LIBCUDA;
    else process.env.MEGAMOE_LIBCUDA = saved;
  }
});

test("explicit overrides win and are not second-guessed", () => {
  const le = fakeEnv(["/opt/x/libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1"], {
    MEGAMOE_LIBCUDA: "/opt/x/libcuda.so.1",
  });
  assert.deepEqual(locateLibcuda(le), {
    ok: true,
    path: "/opt/x/libcuda.so.1",
    searched: ["/opt/x/libcuda.so.1"],
  });
  const missing = fakeEnv(["/usr/local/nvidia/lib64/libcuda.so.1"], {
    MEGAMOE_LIBNVRTC: "/missing/libnvrtc.so.13",
  });
  const r = locateLibnvrtc(missing);
  assert.equal(r.ok, false);
  if (!r.ok) assert.match(r.reason, /MEGAMOE_LIBNVRTC/);
});

test("search order: LD_LIBRARY_PATH, CUDA_HOME, /usr/local/nvidia, system, /usr/local/cuda, versioned", () => {
  const all = [
    "/ld/libcuda.so.1",
    "/cudahome/lib64/libcuda.so.1",
    "/usr/local/nvidia/lib64/libcuda.so.1",
    "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
    "/usr/local/cuda/lib64/libcuda.so.1",
  ];
  const env = { LD_LIBRARY_PATH: "/ld", CUDA_HOME: "/cudahome" };
  for (let i = 0; i < all.length; i++) {
    const r = locateLibcuda(fakeEnv(all.slice(i), env));
    if (process.arch === "x64" || !all[i]!.includes("x86_64")) assert.equal(r.ok && r.path, all[i]);
  }
  const targets = locateLibcuda(
    fakeEnv(["/cudahome/targets/x86_64-linux/lib/libcuda.so.1"], { CUDA_PATH: "/cudahome" }),
  );
  if (process.arch === "x64")
    assert.equal(targets.ok && targets.path, "/cudahome/targets/x86_64-linux/lib/libcuda.so.1");
});

test("libnvrtc.so.13 anywhere beats libnvrtc.so.12 earlier in the order", () => {
  const le = fakeEnv([
    "/usr/local/nvidia/lib64/libnvrtc.so.12",
    "/usr/local/cuda-13.0/targets/x86_64-linux/lib/libnvrtc.so.13",
  ]);
  const r = locateLibnvrtc(le);
  if (process.arch === "x64")
    assert.equal(r.ok && r.path, "/usr/local/cuda-13.0/targets/x86_64-linux/lib/libnvrtc.so.13");
  const only12 = locateLibnvrtc(fakeEnv(["/usr/local/cuda/lib64/libnvrtc.so.12"]));
  assert.equal(only12.ok && only12.path, "/usr/local/cuda/lib64/libnvrtc.so.12");
});

test("pip wheels are searched last, and python3 is asked only when needed", () => {
  const site = "/venv/lib/python3.11/site-packages";
  const found = fakeEnv(
    [`${site}/nvidia/cuda_nvrtc/lib/libnvrtc.so.12`, `${site}/nvidia/cu13/lib/libnvrtc.so.13`],
    {},
    [site],
  );
  const r = locateLibnvrtc(found);
  assert.equal(r.ok && r.path, `${site}/nvidia/cu13/lib/libnvrtc.so.13`);
  assert.equal(found.siteCalls, 1);
  const direct = fakeEnv(["/usr/local/cuda/lib64/libnvrtc.so.13"], {}, [site]);
  assert.ok(locateLibnvrtc(direct).ok);
  assert.equal(direct.siteCalls, 0, "python3 must not run when a system copy exists");
});

test("nothing found: the reason lists every folder searched", () => {
  const r = locateLibcuda(fakeEnv([], { CUDA_HOME: "/cudahome" }, ["/site"]));
  assert.equal(r.ok, false);
  if (!r.ok) {
    for (const dir of [
      "/cudahome/lib64",
      "/usr/local/nvidia/lib64",
      "/usr/local/cuda/lib64",
      "/usr/local/cuda-12.8/lib64",
      "/site/nvidia/cu13/lib",
    ]) {
      assert.ok(r.reason.includes(dir), `reason should mention ${dir}: ${r.reason}`);
    }
    assert.match(r.reason, /^libcuda not found \(libcuda\.so\.1\)/);
  }
});

test("nvcc from CUDA_HOME, then PATH; CUDA headers next to NVRTC first", () => {
  const fromHome = locateNvcc(fakeEnv(["/ch/bin/nvcc", "/p/nvcc"], { CUDA_HOME: "/ch", PATH: "/p" }));
  assert.equal(fromHome.ok && fromHome.path, "/ch/bin/nvcc");
  const viaPath = locateNvcc(fakeEnv(["/p/nvcc"], { PATH: "/a:/p" }));
  assert.equal(viaPath.ok && viaPath.path, "/p/nvcc");
  const inc = locateCudaInclude(
    "/r/targets/x86_64-linux/lib/libnvrtc.so.13",
    fakeEnv(["/r/targets/x86_64-linux/include/cuda_fp8.h", "/usr/local/cuda/include/cuda_fp8.h"]),
  );
  assert.equal(inc.ok && inc.path, "/r/targets/x86_64-linux/include");
});

test("on this machine the real lookups return a path or a reason, never throw", () => {
  for (const r of [locateLibcuda(), locateLibnvrtc(), locateNvcc(), locateCudaInclude()]) {
    if (r.ok) assert.ok(defaultLocateEnv.fileExists(r.path) || r.path.endsWith("include"));
    else assert.ok(r.reason.length > 20);
  }
});
