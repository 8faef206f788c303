/**
 * Specializations of norm.cu: the same as quant.cu's (one per hidden size and scale format, the same
 * -D macros), so it shares their list. Shared by the launcher and the CI compile check.
 */
export { quantDefines as normDefines, variants } from "../quant/quant.variants.js";
