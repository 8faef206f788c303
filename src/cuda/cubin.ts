/**
 * What a cubin says about its kernels, read from the ELF image without a GPU: each entry function's
 * registers per thread and its parameters (ordinal, byte offset, size), from the `.nv.info` sections
 * ptxas writes (EIATTR_REGCOUNT in `.nv.info`, EIATTR_KPARAM_INFO in `.nv.info.<function>`). An exporter
 * plans grids from the registers, and tests check a launch's argument layout against the parameters.
 */

/** One kernel parameter as ptxas laid it out in the parameter buffer. */
export interface CubinParam {
  ordinal: number;
  /** Byte offset in the parameter buffer. */
  offset: number;
  bytes: number;
}

export interface CubinFunction {
  name: string;
  registers: number;
  /** By ordinal. */
  params: CubinParam[];
}

export class CubinFormatError extends Error {
  override name = "CubinFormatError";
}

const EM_CUDA = 190;
const SHT_SYMTAB = 2;
// .nv.info attribute formats and the two attributes read here (ptxas's EIATTR numbering).
const EIFMT_NVAL = 1;
const EIFMT_BVAL = 2;
const EIFMT_HVAL = 3;
const EIFMT_SVAL = 4;
const EIATTR_KPARAM_INFO = 0x17;
const EIATTR_REGCOUNT = 0x2f;

interface Section {
  name: string;
  type: number;
  offset: number;
  size: number;
  link: number;
  entsize: number;
}

/** The .nv.info entries of one section: [attribute, value bytes]. */
function infoEntries(image: DataView, s: Section): [number, DataView][] {
  const entries: [number, DataView][] = [];
  let at = s.offset;
  const end = s.offset + s.size;
  while (at + 4 <= end) {
    const format = image.getUint8(at);
    const attr = image.getUint8(at + 1);
    if (format === EIFMT_SVAL) {
      const size = image.getUint16(at + 2, true);
      entries.push([attr, new DataView(image.buffer, image.byteOffset + at + 4, size)]);
      at += 4 + size;
    } else if (format === EIFMT_NVAL || format === EIFMT_BVAL || format === EIFMT_HVAL) {
      entries.push([attr, new DataView(image.buffer, image.byteOffset + at + 2, 2)]);
      at += 4;
    } else {
      throw new CubinFormatError(`${s.name}: unknown attribute format ${format} at byte ${at - s.offset}`);
    }
  }
  return entries;
}

/** The entry functions of a sm_90 cubin (an ELF64 image for EM_CUDA), with registers and parameters. */
export function readCubinFunctions(cubin: Uint8Array): CubinFunction[] {
  const image = new DataView(cubin.buffer, cubin.byteOffset, cubin.byteLength);
  const magic = cubin.length >= 64 && cubin[0] === 0x7f && cubin[1] === 0x45 && cubin[2] === 0x4c;
  if (!magic || cubin[3] !== 0x46 || cubin[4] !== 2 || image.getUint16(18, true) !== EM_CUDA) {
    throw new CubinFormatError("not a 64-bit CUDA ELF image (a cubin)");
  }
  const shoff = Number(image.getBigUint64(0x28, true));
  const shentsize = image.getUint16(0x3a, true);
  const shnum = image.getUint16(0x3c, true);
  const shstrndx = image.getUint16(0x3e, true);
  if (shoff + shnum * shentsize > cubin.length) throw new CubinFormatError("section headers past the end");
  const raw = Array.from({ length: shnum }, (_, i) => {
    const o = shoff + i * shentsize;
    return {
      nameOffset: image.getUint32(o, true),
      type: image.getUint32(o + 4, true),
      offset: Number(image.getBigUint64(o + 24, true)),
      size: Number(image.getBigUint64(o + 32, true)),
      link: image.getUint32(o + 40, true),
      entsize: Number(image.getBigUint64(o + 56, true)),
    };
  });
  const cString = (at: number) => {
    let end = at;
    while (end < cubin.length && cubin[end] !== 0) end++;
    return new TextDecoder().decode(cubin.subarray(at, end));
  };
  const names = raw[shstrndx];
  if (names === undefined) throw new CubinFormatError("no section name table");
  const sections: Section[] = raw.map((s) => ({ ...s, name: cString(names.offset + s.nameOffset) }));

  // Symbol index → name, for EIATTR_REGCOUNT's (symbol, count) pairs.
  const symtab = sections.find((s) => s.type === SHT_SYMTAB);
  const strtab = symtab === undefined ? undefined : sections[symtab.link];
  const symbolName = (index: number): string | undefined => {
    if (symtab === undefined || strtab === undefined || symtab.entsize === 0) return undefined;
    const at = symtab.offset + index * symtab.entsize;
    if (index * symtab.entsize >= symtab.size) return undefined;
    return cString(strtab.offset + image.getUint32(at, true));
  };

  const registers = new Map<string, number>();
  const global = sections.find((s) => s.name === ".nv.info");
  if (global !== undefined) {
    for (const [attr, v] of infoEntries(image, global)) {
      if (attr !== EIATTR_REGCOUNT || v.byteLength < 8) continue;
      const name = symbolName(v.getUint32(0, true));
      if (name !== undefined) registers.set(name, v.getUint32(4, true));
    }
  }
  const functions: CubinFunction[] = [];
  for (const s of sections) {
    if (!s.name.startsWith(".nv.info.")) continue;
    const name = s.name.slice(".nv.info.".length);
    const params: CubinParam[] = [];
    for (const [attr, v] of infoEntries(image, s)) {
      if (attr !== EIATTR_KPARAM_INFO || v.byteLength < 12) continue;
      // index u32, ordinal u16, offset u16, then flags whose bits 18..31 are the size in bytes.
      params.push({
        ordinal: v.getUint16(4, true),
        offset: v.getUint16(6, true),
        bytes: (v.getUint32(8, true) >>> 18) & 0x3fff,
      });
    }
    params.sort((a, b) => a.ordinal - b.ordinal);
    functions.push({ name, registers: registers.get(name) ?? 0, params });
  }
  return functions;
}

/** One entry function of a cubin, or a CubinFormatError naming the functions it has. */
export function cubinFunction(cubin: Uint8Array, name: string): CubinFunction {
  const all = readCubinFunctions(cubin);
  const f = all.find((x) => x.name === name);
  if (f === undefined) {
    throw new CubinFormatError(
      `the cubin has no function "${name}" (it has ${all.map((x) => x.name).join(", ") || "none"})`,
    );
  }
  return f;
}
