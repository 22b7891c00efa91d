// The panel's calls to the server extension (sandbox_kernel/jupyter_panel/handlers.py). The
// browser speaks only to the Jupyter server, under its own authentication; the engine's
// token or the CreateOS key never reach it.
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export interface IOwner {
  kind: string; // notebook | kernel | kept | orphaned | restarting | warm pool | none
  label: string;
}

export interface ISandbox {
  id: string;
  name: string;
  status: string;
  shape: string;
  vcpu: number;
  mem_mib: number;
  created_at: string;
  age: string;
  forked_from: string | null;
  owner: IOwner;
  cost_per_hour: number;
  cost_so_far: number;
  driven_by: string[];
  usage?: IUsage | null; // only for the notebook in focus (kernels/ID?usage=1)
}

export interface IUsage {
  cpu_percent: number | null;
  memory_used: number | null;
  memory_total: number | null;
}

export interface IListing {
  provider: string;
  sandboxes: ISandbox[];
  prices?: string;
  note?: string;
}

export interface IRefusal {
  at: string;
  host: string;
  port: number;
  reason: string;
}

export interface IEgress {
  rules: string[];
  block_all: boolean;
  denied_count: number | null;
  denied: IRefusal[];
  note?: string;
}

export interface ICurrent {
  sandbox: ISandbox | null;
  provider?: string;
}

/** One clear line from the server extension's JSON error, or the HTTP status. */
export class PanelError extends Error {}

export async function call<T>(path: string, method = 'GET', body?: unknown): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'sandbox-kernel', path);
  const init: RequestInit = { method };
  if (body !== undefined) {
    init.body = JSON.stringify(body);
  }
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new PanelError(`the Jupyter server did not answer: ${error}`);
  }
  let data: any = null;
  try {
    data = await response.json();
  } catch {
    data = null;
  }
  if (!response.ok) {
    throw new PanelError(data?.message || `${response.status} ${response.statusText}`);
  }
  return data as T;
}

export function sandboxPath(id: string, ...rest: string[]): string {
  return ['sandboxes', encodeURIComponent(id), ...rest].join('/');
}

export function dollars(value: number): string {
  return `$${value.toFixed(4)}`;
}
