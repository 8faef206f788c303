/**
 * One value per (device, key), made on first use: the launchers keep their compiled and loaded kernels
 * (and argument blocks) this way, so a kernel family compiles each specialization once per device.
 */
import type { Device } from "./driver.js";

export type PerDeviceMemo<K, V> = (device: Device, key: K, make: () => V) => V;

/** One value per device (a family with a single specialization, a per-device buffer). */
export type PerDeviceOnce<V> = (device: Device, make: () => V) => V;

export function perDeviceOnce<V>(): PerDeviceOnce<V> {
  const memo = perDeviceMemo<null, V>();
  return (device, make) => memo(device, null, make);
}

export function perDeviceMemo<K, V>(): PerDeviceMemo<K, V> {
  const byDevice = new WeakMap<Device, Map<K, V>>();
  return (device, key, make) => {
    let values = byDevice.get(device);
    if (values === undefined) {
      values = new Map();
      byDevice.set(device, values);
    }
    let value = values.get(key);
    if (value === undefined) {
      value = make();
      values.set(key, value);
    }
    return value;
  };
}
